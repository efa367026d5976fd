//! The admission queue: requests waiting for a full fleet, one queue per Envoy process.
//!
//! Why one value in shared data: every worker thread runs its own VM, and a queue per worker
//! would be as many unfair queues as workers. The whole queue — its waiting requests and the
//! tenants' virtual token counters — is one value (`QUEUE_KEY`) updated by compare-and-swap,
//! bounded by `tuning.admission_queue_max` waiting requests and [`MAX_TENANTS`] counters.
//!
//! **Order** (best first): higher priority; then the tenant with the lower *virtual token
//! counter*; then arrival. A counter is the tokens its tenant was admitted with from the queue
//! (prompt estimate at admission, plus [`OUTPUT_WEIGHT`] × completion tokens when known), as in
//! Sheng et al., "Fairness in Serving Large Language Models" (OSDI '24), and AIBrix: a
//! steady tenant under a burst is always next, since the burst's counter runs ahead of it.
//! *No banked credit*: a tenant that starts waiting while others wait starts at their minimum
//! counter (never below its own); to an empty queue, at the maximum of every counter kept.
//!
//! **Lifecycle of an entry** (`Wait`): `Waiting` → `Admitted` (by any VM's tick, charging its
//! tenant) or `Refused` (its wait ran out, or a better-ranked newcomer took its place in a full
//! queue); the VM that owns it ([`Waiter::vm`]) takes it out at its next tick and resumes or
//! answers the paused request. A client that goes away takes its entry out ([`Queue::leave`]).
//! Entries `Admitted` but not yet taken count against the room, so one free slot is given once.
//!
//! **A light tenant's pass** ([`Queue::admit_light`]): each counter also counts its tenant's
//! requests admitted from the queue and not yet ended ([`Queue::done`]); where other replicas
//! share the engines, a tenant with none goes past the room with one request.
//!
//! **Sheddable** (priority < 0) requests never wait: when the fleet is full they are refused.

use crate::scheduler::state::codec::{Reader, Writer};

/// The shared-data key of the queue.
pub const QUEUE_KEY: &str = "computeflux/admission";
/// Tenants whose counters are kept; past it the least recently seen without a waiting request
/// is forgotten (it starts again at the minimum).
pub const MAX_TENANTS: usize = 256;
/// Weight of a completion token against a prompt token in the counters (Sheng et al. use 2).
pub const OUTPUT_WEIGHT: u64 = 2;
/// Hard cap on entries whatever the configuration (the value's size bound).
pub const MAX_ENTRIES: usize = 20_000;

const VERSION: u8 = 2;

/// Why a waiting request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The queue was full and the request ranked last (or was sheddable).
    QueueFull,
    /// It waited `admission_max_wait_ms`.
    Timeout,
}

impl Refusal {
    pub fn code(self) -> &'static str {
        match self {
            Refusal::QueueFull => "queue_full",
            Refusal::Timeout => "queue_timeout",
        }
    }
}

/// Where a queued request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    Waiting,
    Admitted,
    Refused(Refusal),
}

/// One waiting request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiter {
    pub seq: u32,
    /// The VM that paused it, and its context id there.
    pub vm: u32,
    pub ctx: u32,
    pub tenant: u64,
    pub priority: i8,
    /// Hash of its model: which endpoints' room it waits for.
    pub model: u64,
    /// Its prompt estimate in tokens, charged to its tenant when admitted.
    pub cost: u32,
    pub since_ms: u64,
    pub state: Wait,
}

/// A tenant's virtual token counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter {
    pub tenant: u64,
    pub served: u64,
    pub seen_ms: u64,
    /// Its requests admitted from the queue and not yet ended ([`Queue::done`]).
    pub in_flight: u32,
}

/// The bounds and rules of a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub max_waiting: usize,
    pub max_wait_ms: u64,
}

/// A request asking to be admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrival {
    pub vm: u32,
    pub ctx: u32,
    pub tenant: u64,
    pub priority: i8,
    pub model: u64,
    pub cost: u32,
}

/// What an arrival gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrived {
    /// Go now.
    Direct,
    /// Paused: wait for the tick (its sequence number).
    Queued(u32),
    Refused(Refusal),
}

/// What the owner of an entry must do with its paused request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    pub ctx: u32,
    pub seq: u32,
    /// `None`: admitted; else refused for this reason.
    pub refused: Option<Refusal>,
    /// How long it waited.
    pub waited_ms: u64,
    pub priority: i8,
    pub tenant: u64,
}

/// The room for a model: `None` unbounded (nothing known to be full), else the free slots.
pub type Room = Option<u32>;

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Queue {
    pub next_seq: u32,
    pub waiters: Vec<Waiter>,
    pub counters: Vec<Counter>,
}

impl Queue {
    /// Waiting (not yet admitted nor refused) entries.
    pub fn waiting(&self) -> usize {
        self.waiters
            .iter()
            .filter(|w| w.state == Wait::Waiting)
            .count()
    }

    fn counter(&self, tenant: u64) -> Option<u64> {
        self.counters
            .iter()
            .find(|c| c.tenant == tenant)
            .map(|c| c.served)
    }

    /// The counter a tenant is ranked by: its own, or (forgotten) the minimum of the waiting.
    fn rank_counter(&self, tenant: u64) -> u64 {
        self.counter(tenant)
            .unwrap_or_else(|| self.min_waiting_counter().unwrap_or(0))
    }

    fn min_waiting_counter(&self) -> Option<u64> {
        self.waiters
            .iter()
            .filter(|w| w.state == Wait::Waiting)
            .filter_map(|w| self.counter(w.tenant))
            .min()
    }

    /// The rank keys of all entries, aligned with `waiters` (smaller is better; only those of
    /// waiting entries mean anything): priority first, then the entry's *virtual finish*, its
    /// tenant's counter plus the costs of that tenant's earlier waiting entries (so a tenant
    /// with many waiting is interleaved with others, not served in one run), then arrival.
    /// Admitting a tenant's first entry moves its cost from the sum into the counter: the
    /// keys of the entries left do not change.
    fn ranks(&self) -> Vec<(i16, u64, u32)> {
        let mut ahead: Vec<(u64, u64)> = Vec::new();
        let mut order: Vec<usize> = (0..self.waiters.len()).collect();
        order.sort_by_key(|&i| self.waiters.get(i).map_or(0, |w| w.seq));
        let mut out = vec![(i16::MAX, u64::MAX, u32::MAX); self.waiters.len()];
        for i in order {
            let Some(w) = self.waiters.get(i) else {
                continue;
            };
            if w.state != Wait::Waiting {
                continue;
            }
            let base = self.rank_counter(w.tenant);
            let acc = match ahead.iter_mut().find(|(t, _)| *t == w.tenant) {
                Some((_, a)) => a,
                None => {
                    ahead.push((w.tenant, 0));
                    match ahead.last_mut() {
                        Some((_, a)) => a,
                        None => continue,
                    }
                }
            };
            if let Some(slot) = out.get_mut(i) {
                *slot = (-i16::from(w.priority), base.saturating_add(*acc), w.seq);
            }
            *acc = acc.saturating_add(u64::from(w.cost));
        }
        out
    }

    /// Admitted entries not yet taken by their owner, for `model`.
    fn pending(&self, model: u64) -> u32 {
        self.waiters
            .iter()
            .filter(|w| w.model == model && w.state == Wait::Admitted)
            .count() as u32
    }

    /// Lifts `tenant`'s counter as it starts waiting (no banked credit), creating it if new;
    /// evicts the least recently seen counter past [`MAX_TENANTS`].
    fn join(&mut self, tenant: u64, now_ms: u64) {
        let already_waiting = self
            .waiters
            .iter()
            .any(|w| w.tenant == tenant && w.state == Wait::Waiting);
        let floor = if already_waiting {
            0
        } else if self.waiting() > 0 {
            self.min_waiting_counter().unwrap_or(0)
        } else {
            self.counters.iter().map(|c| c.served).max().unwrap_or(0)
        };
        if let Some(c) = self.counters.iter_mut().find(|c| c.tenant == tenant) {
            c.served = c.served.max(floor);
            c.seen_ms = now_ms;
            return;
        }
        if self.counters.len() >= MAX_TENANTS {
            let waiting: Vec<u64> = self
                .waiters
                .iter()
                .filter(|w| w.state == Wait::Waiting)
                .map(|w| w.tenant)
                .collect();
            let victim = self
                .counters
                .iter()
                .enumerate()
                .filter(|(_, c)| !waiting.contains(&c.tenant))
                .min_by_key(|(_, c)| c.seen_ms)
                .or_else(|| {
                    self.counters
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, c)| c.seen_ms)
                })
                .map(|(i, _)| i);
            if let Some(i) = victim {
                self.counters.swap_remove(i);
            }
        }
        self.counters.push(Counter {
            tenant,
            served: floor,
            seen_ms: now_ms,
            in_flight: 0,
        });
    }

    /// Adds `tokens` to `tenant`'s counter, if it is kept.
    pub fn charge(&mut self, tenant: u64, tokens: u64) {
        if let Some(c) = self.counters.iter_mut().find(|c| c.tenant == tenant) {
            c.served = c.served.saturating_add(tokens);
        }
    }

    /// A request of `tenant` admitted from the queue ended: one fewer in flight, and its
    /// completion's `tokens` charged.
    pub fn ended(&mut self, tenant: u64, tokens: u64) {
        if let Some(c) = self.counters.iter_mut().find(|c| c.tenant == tenant) {
            c.served = c.served.saturating_add(tokens);
            c.in_flight = c.in_flight.saturating_sub(1);
        }
    }

    /// Admitted: charged its prompt, one more in flight.
    fn admitted(&mut self, i: usize) -> Option<u64> {
        let w = self.waiters.get_mut(i)?;
        w.state = Wait::Admitted;
        let (tenant, cost, model) = (w.tenant, w.cost, w.model);
        if let Some(c) = self.counters.iter_mut().find(|c| c.tenant == tenant) {
            c.served = c.served.saturating_add(u64::from(cost));
            c.in_flight = c.in_flight.saturating_add(1);
        }
        Some(model)
    }

    /// *A light tenant's pass*: for each model whose engines this Envoy shares with others
    /// (`shared`, asked once per model), the best-ranked waiting request of a tenant with
    /// nothing admitted from the queue in flight goes now, past the model's room; one per
    /// tenant and model per round. Returns whether anything changed.
    ///
    /// Why: with several replicas each holds about `1 / N` of the slots, so a request waits for
    /// one of *its* replica's slots to free, N times fewer than one Envoy's; a tenant sending a
    /// request now and then waited behind that turnover (three replicas, `noisy_neighbor`: the
    /// quiet tenant's requests waited up to 1.35 s in the filter where one Envoy held them at
    /// most 0.23 s). Its one request goes on to the engine with the most room instead, and the
    /// engines' next scrape has the replicas give the excess back in proportion (see
    /// `share`). A tenant over capacity always has requests in flight: it never passes. With
    /// one Envoy nothing is shared and nothing passes (it sees every slot free at once).
    pub fn admit_light(&mut self, mut shared: impl FnMut(u64) -> bool) -> bool {
        let ranks = self.ranks();
        let mut asked: Vec<(u64, bool)> = Vec::new();
        let mut passed: Vec<(u64, u64)> = Vec::new();
        let mut order: Vec<usize> = (0..self.waiters.len()).collect();
        order.sort_by_key(|&i| {
            ranks
                .get(i)
                .copied()
                .unwrap_or((i16::MAX, u64::MAX, u32::MAX))
        });
        let mut changed = false;
        for i in order {
            let Some(w) = self.waiters.get(i).copied() else {
                continue;
            };
            if w.state != Wait::Waiting || passed.contains(&(w.tenant, w.model)) {
                continue;
            }
            // The best-ranked entry of each tenant only (in flight or not, its later ones
            // wait behind it).
            passed.push((w.tenant, w.model));
            let light = self
                .counters
                .iter()
                .find(|c| c.tenant == w.tenant)
                .is_some_and(|c| c.in_flight == 0)
                && !self
                    .waiters
                    .iter()
                    .any(|x| x.tenant == w.tenant && x.state == Wait::Admitted);
            if !light {
                continue;
            }
            let share = match asked.iter().find(|(m, _)| *m == w.model) {
                Some((_, s)) => *s,
                None => {
                    let s = shared(w.model);
                    asked.push((w.model, s));
                    s
                }
            };
            if share {
                self.admitted(i);
                changed = true;
            }
        }
        changed
    }

    /// A request asks to go, its model having `room`. Goes at once when the model has room
    /// and nobody waits for it; else waits (sheddable: refused), displacing the worst-ranked
    /// waiting entry from a full queue if it ranks better.
    pub fn arrive(&mut self, a: Arrival, room: Room, rule: &Rule, now_ms: u64) -> Arrived {
        let waiting_for_model = self
            .waiters
            .iter()
            .any(|w| w.model == a.model && w.state == Wait::Waiting);
        let free = room.map(|r| r.saturating_sub(self.pending(a.model)));
        if !waiting_for_model && free.is_none_or(|f| f > 0) {
            return Arrived::Direct;
        }
        if a.priority < 0 {
            return Arrived::Refused(Refusal::QueueFull);
        }
        let max = rule.max_waiting.clamp(1, MAX_ENTRIES);
        // Entries already decided but not taken by their owner still take space: never more
        // than twice the bound in all.
        if self.waiters.len() >= max.saturating_mul(2).min(MAX_ENTRIES) {
            return Arrived::Refused(Refusal::QueueFull);
        }
        self.join(a.tenant, now_ms);
        let seq = self.next_seq;
        self.next_seq = self.next_seq.wrapping_add(1);
        let me = Waiter {
            seq,
            vm: a.vm,
            ctx: a.ctx,
            tenant: a.tenant,
            priority: a.priority,
            model: a.model,
            cost: a.cost,
            since_ms: now_ms,
            state: Wait::Waiting,
        };
        if self.waiting() >= max {
            self.waiters.push(me);
            let ranks = self.ranks();
            let worst = ranks
                .iter()
                .enumerate()
                .filter(|(i, _)| {
                    self.waiters
                        .get(*i)
                        .is_some_and(|w| w.state == Wait::Waiting)
                })
                .max_by_key(|(_, r)| **r)
                .map(|(i, _)| i);
            let last = self.waiters.len() - 1;
            match worst {
                Some(i) if i != last => {
                    if let Some(w) = self.waiters.get_mut(i) {
                        w.state = Wait::Refused(Refusal::QueueFull);
                    }
                    return Arrived::Queued(seq);
                }
                _ => {
                    self.waiters.pop();
                    return Arrived::Refused(Refusal::QueueFull);
                }
            }
        }
        self.waiters.push(me);
        Arrived::Queued(seq)
    }

    /// Expires entries past their wait, then admits waiting entries in order while their
    /// model has room (`room_of`, asked once per model), charging their tenants. Returns
    /// whether anything changed.
    pub fn admit(
        &mut self,
        rule: &Rule,
        now_ms: u64,
        mut room_of: impl FnMut(u64) -> Room,
    ) -> bool {
        let mut changed = false;
        for w in &mut self.waiters {
            if w.state == Wait::Waiting && now_ms.saturating_sub(w.since_ms) > rule.max_wait_ms {
                w.state = Wait::Refused(Refusal::Timeout);
                changed = true;
            }
        }
        // Free slots per model, pending admissions taken off; asked once per model.
        let mut free: Vec<(u64, Option<u32>)> = Vec::new();
        let ranks = self.ranks();
        loop {
            let mut best: Option<(usize, (i16, u64, u32))> = None;
            for (i, w) in self.waiters.iter().enumerate() {
                if w.state != Wait::Waiting {
                    continue;
                }
                let f = match free.iter().find(|(m, _)| *m == w.model) {
                    Some((_, f)) => *f,
                    None => {
                        let f = room_of(w.model).map(|r| r.saturating_sub(self.pending(w.model)));
                        free.push((w.model, f));
                        f
                    }
                };
                if f == Some(0) {
                    continue;
                }
                let r = ranks
                    .get(i)
                    .copied()
                    .unwrap_or((i16::MAX, u64::MAX, u32::MAX));
                if best.is_none_or(|(_, b)| r < b) {
                    best = Some((i, r));
                }
            }
            let Some((i, _)) = best else { break };
            let Some(model) = self.admitted(i) else {
                break;
            };
            if let Some((_, Some(f))) = free.iter_mut().find(|(m, _)| *m == model) {
                *f = f.saturating_sub(1);
            }
            changed = true;
        }
        changed
    }

    /// Takes out `vm`'s decided entries: what its tick must resume or answer.
    pub fn take(&mut self, vm: u32, now_ms: u64) -> Vec<Delivery> {
        let mut out = Vec::new();
        self.waiters.retain(|w| {
            let refused = match w.state {
                Wait::Waiting => return true,
                Wait::Admitted => None,
                Wait::Refused(r) => Some(r),
            };
            if w.vm != vm {
                return true;
            }
            out.push(Delivery {
                ctx: w.ctx,
                seq: w.seq,
                refused,
                waited_ms: now_ms.saturating_sub(w.since_ms),
                priority: w.priority,
                tenant: w.tenant,
            });
            false
        });
        out
    }

    /// Whether `vm` has entries here at all (its tick has work while it does).
    pub fn has(&self, vm: u32) -> bool {
        self.waiters.iter().any(|w| w.vm == vm)
    }

    /// The entry `seq` of `vm` leaves (its client went away). Returns whether it was there.
    pub fn leave(&mut self, vm: u32, seq: u32) -> bool {
        let before = self.waiters.len();
        self.waiters.retain(|w| !(w.vm == vm && w.seq == seq));
        self.waiters.len() != before
    }

    /// Waiting entries by priority and by tenant (for the gauges).
    pub fn waiting_of(&self, mut f: impl FnMut(&Waiter)) {
        for w in self.waiters.iter().filter(|w| w.state == Wait::Waiting) {
            f(w);
        }
    }

    /// Codec (little-endian): version `2`, next_seq u32, waiter count u32, waiters (seq u32,
    /// vm u32, ctx u32, tenant u64, priority i8 as u8, model u64, cost u32, since u64, state
    /// u8: 0 waiting, 1 admitted, 2 refused full, 3 refused timeout), counter count u32,
    /// counters (tenant u64, served u64, seen u64, in_flight u32). Version `1` (counters
    /// without in_flight, read as 0) is still read.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::with_capacity(13 + self.waiters.len() * 42 + self.counters.len() * 28);
        w.u8(VERSION);
        w.u32(self.next_seq);
        w.u32(self.waiters.len() as u32);
        for x in &self.waiters {
            w.u32(x.seq);
            w.u32(x.vm);
            w.u32(x.ctx);
            w.u64(x.tenant);
            w.u8(x.priority as u8);
            w.u64(x.model);
            w.u32(x.cost);
            w.u64(x.since_ms);
            w.u8(match x.state {
                Wait::Waiting => 0,
                Wait::Admitted => 1,
                Wait::Refused(Refusal::QueueFull) => 2,
                Wait::Refused(Refusal::Timeout) => 3,
            });
        }
        w.u32(self.counters.len() as u32);
        for c in &self.counters {
            w.u64(c.tenant);
            w.u64(c.served);
            w.u64(c.seen_ms);
            w.u32(c.in_flight);
        }
        w.buf
    }

    /// `None` for anything [`Queue::encode`] does not write (read as an empty queue).
    pub fn decode(bytes: &[u8]) -> Option<Queue> {
        let mut r = Reader::new(bytes);
        let version = r.u8()?;
        if version != VERSION && version != 1 {
            return None;
        }
        let counter_bytes = if version == 1 { 24 } else { 28 };
        let next_seq = r.u32()?;
        let n = r.u32()? as usize;
        if n > MAX_ENTRIES || r.remaining() < n.saturating_mul(42) {
            return None;
        }
        let mut waiters = Vec::with_capacity(n);
        for _ in 0..n {
            waiters.push(Waiter {
                seq: r.u32()?,
                vm: r.u32()?,
                ctx: r.u32()?,
                tenant: r.u64()?,
                priority: r.u8()? as i8,
                model: r.u64()?,
                cost: r.u32()?,
                since_ms: r.u64()?,
                state: match r.u8()? {
                    0 => Wait::Waiting,
                    1 => Wait::Admitted,
                    2 => Wait::Refused(Refusal::QueueFull),
                    3 => Wait::Refused(Refusal::Timeout),
                    _ => return None,
                },
            });
        }
        let m = r.u32()? as usize;
        if m > MAX_TENANTS || r.remaining() != m.saturating_mul(counter_bytes) {
            return None;
        }
        let mut counters = Vec::with_capacity(m);
        for _ in 0..m {
            counters.push(Counter {
                tenant: r.u64()?,
                served: r.u64()?,
                seen_ms: r.u64()?,
                in_flight: if version == 1 { 0 } else { r.u32()? },
            });
        }
        Some(Queue {
            next_seq,
            waiters,
            counters,
        })
    }
}

#[cfg(test)]
mod tests;

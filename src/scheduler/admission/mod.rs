//! Admission: who waits when the fleet is full, and in what order.
//!
//! Why: without it every request goes on to the engines, which queue them in arrival order,
//! and a tenant sending ten times its share takes ten times the capacity while everybody's
//! latency climbs. Here a request whose model's endpoints are all full ([`fleet`]) waits in one
//! bounded queue per Envoy process ([`queue`]), paused in Envoy, and is admitted as slots free,
//! by priority and then by the tokens its tenant ([`who`]) was served; past the queue's bounds
//! it gets a 429 with `Retry-After`. Without overload nothing waits: a request whose model has
//! room and nobody waiting goes at once, after one shared-data read.
//!
//! The room between `routing` (whose verdicts it reads) and `flow` (which pauses and resumes
//! the request).

pub mod fleet;
pub mod queue;
pub mod share;
pub mod who;

use crate::scheduler::state::store::{update_if, Store};
use queue::{Arrival, Arrived, Delivery, Queue, Refusal, Room, Rule, QUEUE_KEY};

/// The queue as stored (absent or undecodable: empty).
pub fn read(store: &dyn Store) -> Queue {
    store
        .get(QUEUE_KEY)
        .0
        .as_deref()
        .and_then(Queue::decode)
        .unwrap_or_default()
}

/// Whether anything is queued at all (one read, no decode of the entries).
pub fn anything_queued(store: &dyn Store) -> bool {
    // The waiter count sits after the version byte and the sequence number.
    store
        .get(QUEUE_KEY)
        .0
        .as_deref()
        .and_then(|b| b.get(5..9))
        .is_some_and(|n| n != [0, 0, 0, 0])
}

/// [`Queue::arrive`] on the stored queue. A queue that cannot be updated (CAS retries
/// exhausted) lets the request go: admission fails open.
pub fn arrive(store: &dyn Store, a: Arrival, room: Room, rule: &Rule, now_ms: u64) -> Arrived {
    let out = update_if(store, QUEUE_KEY, |bytes| {
        let mut q = bytes.and_then(Queue::decode).unwrap_or_default();
        match q.arrive(a, room, rule, now_ms) {
            Arrived::Direct => (None, Arrived::Direct),
            // Refused without a change (the queue is as it was).
            Arrived::Refused(r) => (None, Arrived::Refused(r)),
            queued => (Some(q.encode()), queued),
        }
    });
    out.unwrap_or(Arrived::Direct)
}

/// One admission round for `vm`: expire, admit in order while there is room, give the light
/// tenants their pass ([`Queue::admit_light`]) where `shared_of` says the model's engines are
/// shared with other replicas, and take `vm`'s decided entries out. `room_of` and `shared_of`
/// are asked at most once per model.
pub fn tick(
    store: &dyn Store,
    vm: u32,
    rule: &Rule,
    now_ms: u64,
    mut room_of: impl FnMut(u64) -> Room,
    mut shared_of: impl FnMut(u64) -> bool,
) -> (Vec<Delivery>, Queue) {
    let mut rooms: Vec<(u64, Room)> = Vec::new();
    let out = update_if(store, QUEUE_KEY, |bytes| {
        let Some(mut q) = bytes.and_then(Queue::decode) else {
            return (None, (Vec::new(), Queue::default()));
        };
        let changed = q.admit(rule, now_ms, |m| {
            match rooms.iter().find(|(k, _)| *k == m) {
                Some((_, r)) => *r,
                None => {
                    let r = room_of(m);
                    rooms.push((m, r));
                    r
                }
            }
        });
        let light = q.admit_light(&mut shared_of);
        let changed = changed || light;
        let taken = q.take(vm, now_ms);
        let write = changed || !taken.is_empty();
        (write.then(|| q.encode()), (taken, q))
    });
    // A lost race delivers nothing this round; the next tick retries.
    out.unwrap_or_default()
}

/// The entry `seq` of `vm` leaves the queue (its client went away).
pub fn leave(store: &dyn Store, vm: u32, seq: u32) -> bool {
    update_if(store, QUEUE_KEY, |bytes| {
        let Some(mut q) = bytes.and_then(Queue::decode) else {
            return (None, false);
        };
        let left = q.leave(vm, seq);
        (left.then(|| q.encode()), left)
    })
    .unwrap_or(false)
}

/// A request of `tenant` admitted from the queue ended ([`Queue::ended`]): its completion's
/// `tokens` (weighted) charged, one fewer in flight.
pub fn ended(store: &dyn Store, tenant: u64, tokens: u64) {
    let _ = update_if(store, QUEUE_KEY, |bytes| {
        let Some(mut q) = bytes.and_then(Queue::decode) else {
            return (None, ());
        };
        if !q.counters.iter().any(|c| c.tenant == tenant) {
            return (None, ());
        }
        q.ended(tenant, tokens);
        (Some(q.encode()), ())
    });
}

/// The `Retry-After` of a refusal, in seconds: half the longest wait for a full queue (the
/// queue turns over within it), the whole wait after a timeout; at least 1.
pub fn retry_after_s(refusal: Refusal, max_wait_ms: u64) -> u64 {
    let ms = match refusal {
        Refusal::QueueFull => max_wait_ms / 2,
        Refusal::Timeout => max_wait_ms,
    };
    ms.div_ceil(1000).max(1)
}

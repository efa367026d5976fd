//! The request's side of admission: ask to go when its body is read, wait paused when the
//! fleet serving its model is full, go or be refused when the queue decides, leave the queue
//! when the client goes away (see `admission`).

use super::{Flow, Observer, Phase, Step};
use crate::scheduler::admission::queue::{Arrival, Arrived, Refusal, Rule};
use crate::scheduler::admission::who::{self, Asker};
use crate::scheduler::admission::{self, fleet};
use crate::scheduler::config::Config;
use crate::scheduler::routing::select::Scheduler;
use crate::scheduler::wire::reply::{RejectReason, Reply};

/// The response header telling how long a request waited for admission (`expose_headers`).
pub const HEADER_QUEUED_MS: &str = "x-computeflux-queued-ms";

/// Prompt tokens are estimated at 4 body bytes each, as quota-aware routing does.
const BYTES_PER_TOKEN: u64 = 4;

/// What happened to a request at admission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionOutcome {
    /// Went at once (the fleet had room, nobody waited for its model).
    Direct,
    /// Paused in the queue.
    Queued,
    /// Went after waiting.
    Waited,
    /// Refused: the queue was full (or it was sheddable).
    QueueFull,
    /// Refused: it waited as long as it may.
    QueueTimeout,
    /// Its client went away while it waited.
    Abandoned,
}

impl AdmissionOutcome {
    pub const ALL: &'static [AdmissionOutcome] = &[
        AdmissionOutcome::Direct,
        AdmissionOutcome::Queued,
        AdmissionOutcome::Waited,
        AdmissionOutcome::QueueFull,
        AdmissionOutcome::QueueTimeout,
        AdmissionOutcome::Abandoned,
    ];

    pub fn label(self) -> &'static str {
        match self {
            AdmissionOutcome::Direct => "direct",
            AdmissionOutcome::Queued => "queued",
            AdmissionOutcome::Waited => "waited",
            AdmissionOutcome::QueueFull => "queue_full",
            AdmissionOutcome::QueueTimeout => "queue_timeout",
            AdmissionOutcome::Abandoned => "abandoned",
        }
    }
}

/// One admission event for the observer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    pub outcome: AdmissionOutcome,
    pub asker: Asker,
    /// How long it waited (0 for `Direct`, `Queued`).
    pub waited_ms: u64,
}

/// A flow's admission state.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct State {
    /// The VM and context id that own the paused request (set by the glue; (0, 0) natively).
    pub(super) owner: (u32, u32),
    pub(super) asker: Option<Asker>,
    /// Its queue entry while it waits, and since when.
    pub(super) seq: Option<(u32, u64)>,
    /// How long it waited, once admitted after waiting.
    pub(super) waited_ms: Option<u64>,
    /// Its end was told to the queue ([`Flow::admission_done`]).
    pub(super) done: bool,
}

/// The queue's rule from the configuration.
pub fn rule(cfg: &Config) -> Rule {
    Rule {
        max_waiting: usize::try_from(cfg.admission_queue_max).unwrap_or(usize::MAX),
        max_wait_ms: cfg.admission_max_wait_ms,
    }
}

impl Flow {
    /// The VM and context id of this request, for its queue entry (the glue sets them once).
    pub fn set_owner(&mut self, vm: u32, ctx: u32) {
        self.admission.owner = (vm, ctx);
    }

    /// Its queue entry's sequence number while it waits.
    pub fn queued(&self) -> Option<u32> {
        self.admission.seq.map(|(seq, _)| seq)
    }

    /// How long the request waited for admission, if it did.
    pub fn waited_ms(&self) -> Option<u64> {
        self.admission.waited_ms
    }

    /// The body is read: go now, wait, or be refused.
    pub(super) fn admit(&mut self, s: &Scheduler<'_>, obs: &mut dyn Observer, now_ms: u64) -> Step {
        let asker = who::asker(s.cfg, &self.headers);
        self.admission.asker = Some(asker);
        let model = self.model.as_deref();
        // Arriving, it goes while the engines hold at most one beyond their slots each and
        // nobody waits (`fleet::BURST`); the queue admits within the slots.
        let room = if admission::anything_queued(s.store) {
            fleet::room(s, model, now_ms).map(|f| f.burst)
        } else {
            // Nobody waits: its endpoints judged only until a place is found.
            match fleet::arrival(s, model, now_ms) {
                // Without a known bound there is nothing to decide.
                fleet::ArrivalRoom::Unbounded => return self.first_attempt(s, obs, now_ms),
                fleet::ArrivalRoom::Fits => {
                    obs.admission(&Admission {
                        outcome: AdmissionOutcome::Direct,
                        asker,
                        waited_ms: 0,
                    });
                    return self.first_attempt(s, obs, now_ms);
                }
                fleet::ArrivalRoom::Room(burst) => Some(burst),
            }
        };
        let (vm, ctx) = self.admission.owner;
        let arrival = Arrival {
            vm,
            ctx,
            tenant: asker.tenant,
            priority: asker.priority,
            model: fleet::model_key(model),
            cost: u32::try_from((self.prompt_bytes / BYTES_PER_TOKEN).max(1)).unwrap_or(u32::MAX),
        };
        match admission::arrive(s.store, arrival, room, &rule(s.cfg), now_ms) {
            Arrived::Direct => {
                obs.admission(&Admission {
                    outcome: AdmissionOutcome::Direct,
                    asker,
                    waited_ms: 0,
                });
                self.first_attempt(s, obs, now_ms)
            }
            Arrived::Queued(seq) => {
                obs.admission(&Admission {
                    outcome: AdmissionOutcome::Queued,
                    asker,
                    waited_ms: 0,
                });
                self.admission.seq = Some((seq, now_ms));
                self.phase = Phase::Queued;
                Step::Wait
            }
            Arrived::Refused(r) => self.refused(s.cfg, obs, r, 0),
        }
    }

    /// The queue admitted the request after `waited_ms`: route it now.
    pub fn on_admitted(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        waited_ms: u64,
        now_ms: u64,
    ) -> Step {
        if self.phase != Phase::Queued {
            return Step::Continue;
        }
        self.admission.seq = None;
        self.admission.waited_ms = Some(waited_ms);
        // Placed where the room it was admitted for is (a new placement; a pin is kept).
        self.exclusions.placeless = fleet::placeless(s, self.model.as_deref(), now_ms);
        if let Some(asker) = self.admission.asker {
            obs.admission(&Admission {
                outcome: AdmissionOutcome::Waited,
                asker,
                waited_ms,
            });
        }
        self.first_attempt(s, obs, now_ms)
    }

    /// The queue refused the request after `waited_ms`: a 429 with `Retry-After`.
    pub fn on_refused(
        &mut self,
        cfg: &Config,
        obs: &mut dyn Observer,
        refusal: Refusal,
        waited_ms: u64,
    ) -> Step {
        if self.phase != Phase::Queued {
            return Step::Continue;
        }
        self.admission.seq = None;
        self.refused(cfg, obs, refusal, waited_ms)
    }

    fn refused(
        &mut self,
        cfg: &Config,
        obs: &mut dyn Observer,
        refusal: Refusal,
        waited_ms: u64,
    ) -> Step {
        let secs = admission::retry_after_s(refusal, cfg.admission_max_wait_ms);
        let (outcome, reason, msg) = match refusal {
            Refusal::QueueFull => (
                AdmissionOutcome::QueueFull,
                RejectReason::QueueFull,
                format!("Every endpoint for this model is busy and the queue is full; retry in {secs} s."),
            ),
            Refusal::Timeout => (
                AdmissionOutcome::QueueTimeout,
                RejectReason::QueueTimeout,
                format!("Every endpoint for this model stayed busy for {waited_ms} ms; retry in {secs} s."),
            ),
        };
        if let Some(asker) = self.admission.asker {
            obs.admission(&Admission {
                outcome,
                asker,
                waited_ms,
            });
        }
        let reply = Reply::new(429, reason, &msg).retry_after(secs);
        obs.replied(&reply);
        self.phase = Phase::Done;
        Step::Reply(reply)
    }

    /// The client went away (or the stream ended) while the request waited: out of the queue.
    pub(super) fn leave_queue(&mut self, s: &Scheduler<'_>, obs: &mut dyn Observer, now_ms: u64) {
        let Some((seq, since)) = self.admission.seq.take() else {
            return;
        };
        admission::leave(s.store, self.admission.owner.0, seq);
        if let Some(asker) = self.admission.asker {
            obs.admission(&Admission {
                outcome: AdmissionOutcome::Abandoned,
                asker,
                waited_ms: now_ms.saturating_sub(since),
            });
        }
        self.phase = Phase::Done;
    }

    /// A request admitted from the queue ended (once): its tenant has one fewer in flight, and
    /// is charged its completion tokens (weighted) when the answer reported them.
    pub(super) fn admission_done(&mut self, s: &Scheduler<'_>, completion_tokens: u64) {
        if self.admission.done {
            return;
        }
        if let (Some(_), Some(asker)) = (self.admission.waited_ms, self.admission.asker) {
            self.admission.done = true;
            admission::ended(
                s.store,
                asker.tenant,
                completion_tokens.saturating_mul(crate::scheduler::admission::queue::OUTPUT_WEIGHT),
            );
        }
    }
}

//! After the answer: what an attempt's outcome changes, one function per concern, applied in
//! one table write in this order: the attempt itself (in-flight, overdue watch), the success
//! rate, the affinity payoff, the quota, the latency estimate, the degraded probe's backoff,
//! the breaker; then, outside the table, the session's pin.

use super::{Finished, Scheduler, Ticket, DEAD_KEY_ALPHA, TABLE_KEY};
use crate::scheduler::config::Config;
use crate::scheduler::health::breaker::{BreakerConfig, BreakerState};
use crate::scheduler::health::outcome::Outcome;
use crate::scheduler::routing::ewma::{self, LATENCY_FLOOR_MS};
use crate::scheduler::routing::quota::{QuotaHint, QuotaRule};
use crate::scheduler::routing::table::{fastest_warm, EndpointState, Table};
use crate::scheduler::state::store::update_if;

impl Scheduler<'_> {
    /// The first byte of a streamed answer, whose latency sample it is: the attempt stops being
    /// watched for being overdue (its stream may go on for long). One more table write, for
    /// watched attempts only; if it keeps losing the CAS race the finish releases the slot.
    pub fn release_watch(&self, ticket: &mut Ticket) {
        if ticket.watch_token == 0 {
            return;
        }
        let (token, started, id, hint) = (
            ticket.watch_token,
            ticket.started_ms,
            ticket.endpoint_id,
            ticket.endpoint,
        );
        let cfg = self.cfg;
        let result = update_if(self.store, TABLE_KEY, |bytes| {
            let (mut table, same_layout) = Table::load(bytes, cfg);
            let at = table.locate(hint, id);
            let Some((at, (_, st))) = at.and_then(|i| Some((i, table.entries.get_mut(i)?))) else {
                return (None, ());
            };
            if !st.watch.release(token, started) {
                return (None, ());
            }
            let bytes = match bytes {
                Some(stored) if same_layout => table.encode_patched(stored, at),
                _ => table.encode(),
            };
            (Some(bytes), ())
        });
        if result.is_ok() {
            ticket.watch_token = 0;
        }
    }

    /// Records an attempt's outcome: in-flight −1, statistics, breaker, affinity.
    /// `latency_ms` is the time to response headers.
    pub fn finish(
        &self,
        ticket: Ticket,
        outcome: &Outcome,
        latency_ms: u64,
        session: Option<u64>,
        now_ms: u64,
    ) -> Finished {
        self.finish_observed(
            ticket,
            outcome,
            latency_ms,
            session,
            &QuotaHint::default(),
            now_ms,
        )
    }

    /// [`Scheduler::finish`], also remembering the quota a successful answer stated (in the
    /// same write).
    pub fn finish_observed(
        &self,
        ticket: Ticket,
        outcome: &Outcome,
        latency_ms: u64,
        session: Option<u64>,
        quota: &QuotaHint,
        now_ms: u64,
    ) -> Finished {
        let rule = self.quota_rule();
        let bcfg = self.breaker_config();
        let cfg = self.cfg;
        let result = update_if(self.store, TABLE_KEY, |bytes| {
            let (mut table, same_layout) = Table::load(bytes, cfg);
            // The ticket's endpoint, also if a reload moved it; gone: nothing to record.
            let at = table.locate(ticket.endpoint, ticket.endpoint_id);
            // A degraded endpoint's probe is judged against the fastest of the others.
            let fastest_other = if ticket.degraded_probe {
                let others = table.entries.iter().enumerate();
                fastest_warm(
                    others.filter(|(j, _)| Some(*j) != at).map(|(_, (_, o))| o),
                    cfg.cold_start_samples,
                )
            } else {
                None
            };
            let Some((at, (_, st))) = at.and_then(|i| Some((i, table.entries.get_mut(i)?))) else {
                return (None, None);
            };
            end_attempt(st, &ticket, now_ms);
            record_success_rate(st, outcome, cfg, now_ms);
            record_payoff(st, outcome, &ticket, cfg);
            record_quota(st, outcome, quota, &rule, cfg, now_ms);
            record_latency(st, outcome, latency_ms, cfg);
            reset_probe_backoff(st, outcome, &ticket, latency_ms, fastest_other, cfg);
            let changed = record_breaker(st, outcome, &ticket, &bcfg, now_ms);
            let report = Finished {
                breaker_changed: changed,
                breaker: st.breaker.state_at(now_ms),
                latency_ms: st.latency_ms,
                in_flight: st.in_flight,
                stored: true,
                stale: false,
            };
            let bytes = match bytes {
                Some(stored) if same_layout => table.encode_patched(stored, at),
                _ => table.encode(),
            };
            (Some(bytes), Some(report))
        });
        let mut report = match result {
            Ok(r) => r,
            Err(r) => r.map(|mut f| {
                f.stored = false;
                f
            }),
        }
        .unwrap_or(Finished {
            breaker_changed: false,
            breaker: BreakerState::Closed,
            latency_ms: None,
            in_flight: 0,
            stored: true,
            stale: true,
        });
        if let Some(s) = session {
            report.stored &= self.record_affinity(s, outcome, &ticket, now_ms);
        }
        report
    }

    /// The session's pin: a success pins it where the ticket says it should, a dead key
    /// forgets it. False when the affinity write was lost.
    fn record_affinity(
        &self,
        session: u64,
        outcome: &Outcome,
        ticket: &Ticket,
        now_ms: u64,
    ) -> bool {
        let aff = self.affinity();
        match outcome {
            Outcome::Success if ticket.pin_on_success => {
                aff.remember(session, ticket.endpoint_id, now_ms)
            }
            Outcome::DeadKey => aff.forget(session, ticket.endpoint_id),
            _ => true,
        }
    }
}

/// The attempt is over: in-flight −1 (if its +1 was stored), its overdue-watch slot freed.
fn end_attempt(st: &mut EndpointState, ticket: &Ticket, now_ms: u64) {
    if ticket.counted {
        st.in_flight = st.in_flight.saturating_sub(1);
        st.in_flight_changed_ms = now_ms;
    }
    st.watch.release(ticket.watch_token, ticket.started_ms);
}

/// The attempt count and the success-rate EWMA (client errors and cancellations are no
/// verdict on the endpoint).
fn record_success_rate(st: &mut EndpointState, outcome: &Outcome, cfg: &Config, now_ms: u64) {
    let verdict = match outcome {
        Outcome::Success => Some(1.0),
        Outcome::DeadKey | Outcome::RateLimited { .. } | Outcome::EndpointFailure(_) => Some(0.0),
        Outcome::ClientError => None,
        Outcome::Cancelled => None,
    };
    if !matches!(outcome, Outcome::Cancelled) {
        st.total = st.total.saturating_add(1);
    }
    if let Some(v) = verdict {
        // Fold in the fading of the idle penalty first, then the new sample.
        let idle_fade = ewma::fade(now_ms.saturating_sub(st.last_sample_ms), cfg.stats_decay_ms);
        let faded = 1.0 - (1.0 - st.success_rate) * idle_fade;
        // A 401/403 is deterministic (the key is dead), not a flaky sample: it weighs
        // at least DEAD_KEY_ALPHA, so a dead key stops winning first attempts after a
        // couple of requests instead of a dozen.
        let alpha = match outcome {
            Outcome::DeadKey => cfg.success_rate_alpha.max(DEAD_KEY_ALPHA),
            _ => cfg.success_rate_alpha,
        };
        st.success_rate = ewma::update(Some(faded), v, alpha).clamp(0.0, 1.0);
        st.last_sample_ms = now_ms;
    }
}

/// An affinity hit's answer: how much of its prompt the pin saved (see `payoff`).
fn record_payoff(st: &mut EndpointState, outcome: &Outcome, ticket: &Ticket, cfg: &Config) {
    if let (Outcome::Success, Some(u)) = (outcome, &ticket.pinned_usage) {
        st.payoff.observe(u, cfg.payoff_min_prompt_tokens);
    }
}

/// The quota a successful answer stated (`quota_aware`).
fn record_quota(
    st: &mut EndpointState,
    outcome: &Outcome,
    hint: &QuotaHint,
    rule: &QuotaRule,
    cfg: &Config,
    now_ms: u64,
) {
    if matches!(outcome, Outcome::Success) && cfg.quota_aware {
        st.quota.observe(hint, rule, now_ms);
    }
}

/// A success's time to headers: the latency estimate and its mean deviation.
fn record_latency(st: &mut EndpointState, outcome: &Outcome, latency_ms: u64, cfg: &Config) {
    if matches!(outcome, Outcome::Success) {
        let sample = latency_ms as f64;
        if let Some(prev) = st.latency_ms {
            st.latency_dev_ms = ewma::update(
                Some(st.latency_dev_ms),
                (sample - prev).abs(),
                ewma::DEVIATION_ALPHA,
            );
        }
        st.latency_ms = Some(ewma::update(st.latency_ms, sample, cfg.ewma_alpha));
    }
}

/// A degraded endpoint's probe that answered fast (against the fastest of the others) is
/// recovering: it is probed at the base interval again.
fn reset_probe_backoff(
    st: &mut EndpointState,
    outcome: &Outcome,
    ticket: &Ticket,
    latency_ms: u64,
    fastest_other: Option<f64>,
    cfg: &Config,
) {
    let fast_probe = ticket.degraded_probe
        && matches!(outcome, Outcome::Success)
        && fastest_other.is_some_and(|best| {
            (latency_ms as f64) < cfg.degraded_exit_ratio * best.max(LATENCY_FLOOR_MS)
        });
    if fast_probe {
        st.degraded_probes = 0;
    }
}

/// The breaker's transition; whether its state changed.
fn record_breaker(
    st: &mut EndpointState,
    outcome: &Outcome,
    ticket: &Ticket,
    bcfg: &BreakerConfig,
    now_ms: u64,
) -> bool {
    let changed = st.breaker.record(outcome, ticket.probe_epoch, now_ms, bcfg);
    if changed && st.breaker.state == BreakerState::Closed {
        // All probes succeeded: the endpoint has genuinely recovered.
        st.success_rate = 1.0;
    }
    changed
}

//! After an attempt: what its outcome changes, one function per concern (release, success
//! rate, latency, slowness, payoff, quota, probe backoff, breaker, then the work model and
//! the affinity), all in one table write.

use super::*;

impl<'a> Scheduler<'a> {
    /// A stream still running on the ticket's endpoint, `decode_ms` since its first byte with
    /// `decode_bytes` relayed after its first chunk: if its pace against the work model of
    /// `work_key` ([`WorkModel::pace_ratio`]) has reached `pin_break_ratio` × the median
    /// slowness of the endpoint's warm peers — the degraded rule's threshold — it is folded
    /// into the endpoint's slowness now (see `slowness`), before the slow stream ends. Returns
    /// whether it was: the stream's end is then not judged again. One shared-data read per
    /// check (the caller checks at doubling sizes); a pace below half of `pin_break_ratio`
    /// (whatever the peers) stops there, a slower one reads the table for the peers' median
    /// and writes it only if folded.
    pub fn judge_pace(
        &self,
        ticket: &Ticket,
        work_key: &str,
        decode_ms: u64,
        decode_bytes: u64,
        now_ms: u64,
    ) -> bool {
        let model = signals::read_model(self.store, work_key);
        let Some(ratio) = model.pace_ratio(decode_ms as f64, decode_bytes) else {
            return false;
        };
        let cfg = self.cfg;
        if ratio < cfg.pin_break_ratio * slowness::PACE_PEERS_FLOOR {
            return false;
        }
        let min_samples = DegradeRule::from_config(cfg).min_samples;
        let (id, hint) = (ticket.endpoint_id, ticket.endpoint);
        // The peers' median from the table as read; the fold itself on the entry as stored.
        let table = self.load_table().0;
        let Some(at) = table.locate(hint, id) else {
            return false;
        };
        let Some(peers) = signals::peer_median(&table, cfg, at, min_samples) else {
            return false;
        };
        if ratio < cfg.pin_break_ratio * peers {
            return false;
        }
        let mut folded = false;
        let stored = self.change_entry(Some(at), id, |st| {
            folded = st.slowness.observe_pace(ratio, now_ms).is_some();
            folded
        });
        stored == Some(true) && folded
    }

    /// Applies `change` to endpoint `id`'s entry (at position `at` of the layout when it is
    /// there) in one write of its group ([`groups::update_entry`]); `change` returns whether
    /// it changed anything. An entry stored nowhere (no table yet, or an endpoint new to the
    /// stored layout) is written by laying the table out. `Some(changed)`, `None` when the
    /// CAS retries gave up.
    fn change_entry(
        &self,
        at: Option<usize>,
        id: u32,
        mut change: impl FnMut(&mut EndpointState) -> bool,
    ) -> Option<bool> {
        match groups::update_entry(self.store, at, id, &mut change, |_| {}) {
            Some(Ok(changed)) => Some(changed),
            Some(Err(())) => None,
            None => {
                let (mut table, _) = self.load_table();
                let Some(i) = table.locate(at.unwrap_or(usize::MAX), id) else {
                    return Some(false);
                };
                let changed = table.entries.get_mut(i).is_some_and(|(_, st)| change(st));
                if !changed {
                    return Some(false);
                }
                groups::lay_out(self.store, &table, &[i], |_| {}).then_some(true)
            }
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
            Some(latency_ms),
            session,
            &QuotaHint::default(),
            now_ms,
        )
    }

    /// [`Scheduler::finish`], also remembering the quota a successful answer (or a 429 it
    /// explains) stated (in the same write). The bookkeeping is one function per concern, applied to the endpoint's
    /// entry in one table write: [`release`] (in-flight, overdue watch), [`record_success`],
    /// [`record_latency`] (raw EWMA, metrics only), [`record_slowness`], [`record_payoff`],
    /// [`record_quota`], [`record_probe`] (probe backoff), [`record_breaker`]; then the work
    /// model ([`signals::teach`]) and the affinity ([`Scheduler::record_affinity`]).
    /// `latency_ms`: the attempt's latency sample (time to its first byte), `None` when it
    /// could not be seen (no sample is taken).
    pub fn finish_observed(
        &self,
        ticket: Ticket,
        outcome: &Outcome,
        latency_ms: Option<u64>,
        session: Option<u64>,
        quota: &QuotaHint,
        now_ms: u64,
    ) -> Finished {
        let cfg = self.cfg;
        let rule = self.quota_rule();
        let bcfg = self.breaker_config();
        let min_samples = DegradeRule::from_config(cfg).min_samples;
        // The answer judged against the work model of its model group (read before the
        // table write; the model changes by one sample in hundreds).
        let served = match outcome {
            Outcome::Success => ticket.served.as_ref(),
            _ => None,
        };
        let judged = served.map(|s| (s.sample(), signals::read_model(self.store, &s.work_key)));
        // Every concern applied to the endpoint's entry; `reference` is the peers' median
        // slowness, needed by a degraded endpoint's probe only.
        let record = |st: &mut EndpointState, reference: Option<f64>| {
            release(st, &ticket, now_ms, cfg);
            record_success(st, outcome, now_ms);
            record_latency(st, outcome, latency_ms, cfg);
            let ratio = judged
                .as_ref()
                .and_then(|(sample, model)| record_slowness(st, sample, model, now_ms));
            record_payoff(st, outcome, &ticket, cfg);
            let by_quota = record_quota(st, outcome, &ticket, quota, &rule, cfg, now_ms);
            record_degraded_busy(st, &ticket, now_ms);
            record_probe(st, &ticket, ratio, reference, now_ms);
            let changed = record_breaker(st, outcome, &ticket, now_ms, &bcfg, by_quota);
            let report = Finished {
                breaker_changed: changed,
                breaker: st.breaker.state_at(now_ms),
                latency_ms: st.latency_ms,
                in_flight: st.in_flight,
                stored: true,
                stale: false,
            };
            (report, st.degraded)
        };
        let id = ticket.endpoint_id;
        let at = match cfg.endpoints.get(ticket.endpoint) {
            Some(ep) if ep.id == id => Some(ticket.endpoint),
            _ => cfg.endpoint_index(id),
        };
        // A degraded endpoint's probe needs the peers' median (the table read); every other
        // finish reads and rewrites its endpoint's group alone.
        let reference = if ticket.degraded_probe {
            let table = self.load_table().0;
            table
                .locate(ticket.endpoint, id)
                .and_then(|i| signals::peer_median(&table, cfg, i, min_samples))
        } else {
            None
        };
        let mut out = None;
        let stored = self.change_entry(at, id, |st| {
            out = Some(record(st, reference));
            true
        });
        let result = match stored {
            Some(_) => Ok(out),
            None => Err(out),
        };
        let (mut report, degraded) = match result {
            Ok(r) => r,
            Err(r) => r.map(|(mut f, d)| {
                f.stored = false;
                (f, d)
            }),
        }
        .unwrap_or((
            Finished {
                breaker_changed: false,
                breaker: BreakerState::Closed,
                latency_ms: None,
                in_flight: 0,
                stored: true,
                stale: true,
            },
            true,
        ));
        // The fleet's yardstick learns from endpoints that are not degraded only.
        if let (Some(s), Some((sample, _)), false) = (served, &judged, degraded) {
            signals::teach(self.store, &s.work_key, sample, s.decode_bytes);
        }
        report.stored &= self.record_affinity(&ticket, outcome, session, now_ms);
        report
    }

    /// The session's pin after an attempt: a success pins it (unless the ticket says not), a
    /// dead key drops a pin to that endpoint. False when a CAS retry loop gave up.
    pub(super) fn record_affinity(
        &self,
        ticket: &Ticket,
        outcome: &Outcome,
        session: Option<u64>,
        now_ms: u64,
    ) -> bool {
        let Some(s) = session else {
            return true;
        };
        let aff = self.affinity();
        match outcome {
            Outcome::Success if ticket.pin_on_success => {
                // The answer's prompt, for the next turn's payoff check (0: no usage).
                let prompt = ticket
                    .served
                    .as_ref()
                    .and_then(|s| s.usage)
                    .map_or(0, |u| u32::try_from(u.prompt_tokens).unwrap_or(u32::MAX));
                aff.remember_turn(s, ticket.endpoint_id, ticket.placement_key, prompt, now_ms)
            }
            Outcome::DeadKey => aff.forget(s, ticket.endpoint_id),
            _ => true,
        }
    }
}

/// In-flight −1 (if the pick counted it).
pub(super) fn release(st: &mut EndpointState, ticket: &Ticket, now_ms: u64, cfg: &Config) {
    if ticket.counted {
        st.end_attempt(ticket.started_ms, now_ms, cfg.in_flight_max_age_ms);
    }
}

/// The success-rate EWMA and the verdict count (cold start).
pub(super) fn record_success(st: &mut EndpointState, outcome: &Outcome, now_ms: u64) {
    let verdict = match outcome {
        Outcome::Success => Some(1.0),
        Outcome::DeadKey | Outcome::RateLimited { .. } | Outcome::EndpointFailure(_) => Some(0.0),
        Outcome::ClientError | Outcome::Cancelled => None,
    };
    if !matches!(outcome, Outcome::Cancelled) {
        st.total = st.total.saturating_add(1);
    }
    let Some(v) = verdict else {
        return;
    };
    // Fold in the fading of the idle penalty first, then the new sample.
    let idle_fade = ewma::fade(
        now_ms.saturating_sub(st.last_sample_ms),
        crate::scheduler::routing::placement::score::STATS_DECAY_MS,
    );
    let faded = 1.0 - (1.0 - st.success_rate) * idle_fade;
    // A 401/403 is deterministic (the key is dead), not a flaky sample: it weighs at least
    // DEAD_KEY_ALPHA, so a dead key stops winning first attempts after a couple of requests.
    let alpha = match outcome {
        Outcome::DeadKey => SUCCESS_RATE_ALPHA.max(DEAD_KEY_ALPHA),
        _ => SUCCESS_RATE_ALPHA,
    };
    st.success_rate = ewma::update(Some(faded), v, alpha).clamp(0.0, 1.0);
    st.last_sample_ms = now_ms;
}

/// The raw latency EWMA and its mean deviation: for metrics and the score of requests without
/// a session only (raw samples mix unlike work; see `slowness`).
pub(super) fn record_latency(
    st: &mut EndpointState,
    outcome: &Outcome,
    latency_ms: Option<u64>,
    cfg: &Config,
) {
    let (Outcome::Success, Some(ms)) = (outcome, latency_ms) else {
        return;
    };
    let sample = ms as f64;
    if let Some(prev) = st.latency_ms {
        st.latency_dev_ms = ewma::update(
            Some(st.latency_dev_ms),
            (sample - prev).abs(),
            ewma::DEVIATION_ALPHA,
        );
    }
    st.latency_ms = Some(ewma::update(st.latency_ms, sample, cfg.ewma_alpha));
}

/// The endpoint's slowness, from a successful answer judged against the work model. Returns
/// the sample's unclamped ratio (observed ÷ expected), `None` while the model is cold.
pub(super) fn record_slowness(
    st: &mut EndpointState,
    sample: &Sample,
    model: &WorkModel,
    now_ms: u64,
) -> Option<f64> {
    st.slowness.observe(sample, model, now_ms)?;
    Some(sample.observed_ms.max(slowness::FLOOR_MS) / model.expected_ms(sample))
}

/// The affinity payoff, from the usage of an affinity hit's answer.
pub(super) fn record_payoff(
    st: &mut EndpointState,
    outcome: &Outcome,
    ticket: &Ticket,
    cfg: &Config,
) {
    if let (Outcome::Success, Some(u)) = (outcome, &ticket.pinned_usage) {
        st.payoff.observe(u, cfg.payoff_min_prompt_tokens);
    }
}

/// The quota a successful answer used and stated (`quota_aware`): the tokens its `usage`
/// reports replace the pick's estimate, then its headers' statement applies. Any other
/// attempt gives its estimate back ([`Quota::give_back`](crate::scheduler::routing::quota::Quota::give_back)). A 429's
/// statement applies when it explains the refusal ([`Quota::refused`](crate::scheduler::routing::quota::Quota::refused)):
/// returns `true` then, and the breaker is left alone ([`record_breaker`]).
pub(super) fn record_quota(
    st: &mut EndpointState,
    outcome: &Outcome,
    ticket: &Ticket,
    quota: &QuotaHint,
    rule: &QuotaRule,
    cfg: &Config,
    now_ms: u64,
) -> bool {
    if !cfg.quota_aware {
        return false;
    }
    match outcome {
        Outcome::Success => {
            if let Some(u) = ticket.served.as_ref().and_then(|s| s.usage.as_ref()) {
                let used = u.prompt_tokens.saturating_add(u.completion_tokens);
                st.quota
                    .settle_pick(&ticket.quota_mark, used, ticket.started_ms, now_ms);
            }
            st.quota.observe(quota, &ticket.quota_mark, rule, now_ms);
            false
        }
        Outcome::RateLimited { .. }
            if st
                .quota
                .refused(quota, ticket.quota_tokens, &ticket.quota_mark, rule, now_ms) =>
        {
            true
        }
        // No served answer: the upstream charged nothing (a 429 its statement does not
        // explain, a 401/403, a provider's 400, a 5xx, a reset, a client gone).
        _ => {
            st.quota
                .give_back(&ticket.quota_mark, ticket.started_ms, now_ms);
            false
        }
    }
}

/// The probe schedule's start on a degraded endpoint (`EndpointState::degraded_at_ms`, read by
/// `placement::fleet_probes`) leaves out this Envoy's own work there: an answer of a probe
/// moves it on by the probe's length, any other answer (what was in flight or pinned when it
/// was judged, draining) to now. So the time the engine's last decoding is read against is
/// what it spent idle and on the other replicas' probes; with one Envoy, its idle gaps alone,
/// and the count is its own however long its probes or its drain took.
pub(super) fn record_degraded_busy(st: &mut EndpointState, ticket: &Ticket, now_ms: u64) {
    if !st.degraded {
        return;
    }
    st.degraded_at_ms = if ticket.degraded_probe {
        let took = now_ms.saturating_sub(ticket.started_ms);
        st.degraded_at_ms.saturating_add(took).min(now_ms)
    } else {
        st.degraded_at_ms.max(now_ms)
    };
    st.degraded_own_end_ms = st.degraded_own_end_ms.max(now_ms);
}

/// Probe backoff: a degraded endpoint's probe whose answer was fast for its work (its ratio
/// below [`DEGRADED_EXIT_RATIO`](crate::scheduler::config::DEGRADED_EXIT_RATIO) × the peers' median slowness) resets the probe interval,
/// and the probe schedule starts again from now (`EndpointState::degraded_at_ms`).
pub(super) fn record_probe(
    st: &mut EndpointState,
    ticket: &Ticket,
    ratio: Option<f64>,
    reference: Option<f64>,
    now_ms: u64,
) {
    let fast = match (ratio, reference) {
        (Some(r), Some(peers)) => r < crate::scheduler::config::DEGRADED_EXIT_RATIO * peers,
        _ => false,
    };
    if ticket.degraded_probe && fast {
        // Recovering: probe at the base interval again.
        st.degraded_probes = 0;
        st.degraded_at_ms = now_ms;
    }
}

/// The breaker; returns whether its state changed.
///
/// A 429 that the endpoint's quota count explains (`by_quota`, see [`record_quota`]) is the
/// request's size against what the key has left, not the key out of service: it neither
/// opens the breaker nor, as a half-open probe, re-opens it (its slot is given back).
pub(super) fn record_breaker(
    st: &mut EndpointState,
    outcome: &Outcome,
    ticket: &Ticket,
    now_ms: u64,
    bcfg: &BreakerConfig,
    by_quota: bool,
) -> bool {
    let outcome = if by_quota {
        &Outcome::ClientError
    } else {
        outcome
    };
    let changed = st.breaker.record(outcome, ticket.probe_epoch, now_ms, bcfg);
    if changed && st.breaker.state == BreakerState::Closed {
        // All probes succeeded: the endpoint has genuinely recovered.
        st.success_rate = 1.0;
    }
    changed
}

/// Stores a verdict that flipped for its hysteresis; returns whether anything changed. A newly
/// degraded endpoint gets its first probe one interval later.
pub(super) fn store_verdict(
    st: &mut EndpointState,
    degraded: bool,
    saturation: Saturation,
    now_ms: u64,
) -> bool {
    let mut changed = false;
    if st.degraded != degraded {
        st.degraded = degraded;
        st.degraded_probes = 0;
        if degraded {
            st.degraded_probe_ms = now_ms;
            st.degraded_at_ms = now_ms;
            st.degraded_own_end_ms = now_ms;
        }
        changed = true;
    }
    if st.saturation.stored_differs(saturation) {
        st.saturation = saturation;
        changed = true;
    }
    changed
}

//! A request's attempts: the first, failover to the next, and how the flow concludes (an
//! answer relayed, a reply of our own, or a refusal).

use super::*;

impl Flow {
    pub(super) fn first_attempt(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        now_ms: u64,
    ) -> Step {
        match self.start_attempt(s, obs, now_ms) {
            Ok(i) => {
                self.served_by = Some(i);
                self.phase = Phase::Routed;
                Step::Route(i)
            }
            Err(no) if self.holder.is_some() => self.holder_unavailable(s, obs, no, now_ms),
            Err(no) => self.no_endpoint(obs, no, now_ms),
        }
    }

    /// Picks the next attempt's endpoint and keeps its ticket (the only place a [`Pick`] is
    /// made, and the only place a ticket is taken).
    pub(super) fn start_attempt(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        now_ms: u64,
    ) -> Result<usize, NoEndpoint> {
        // An attempt is finished before the next starts; never drop a ticket unfinished.
        if self.current.is_some() {
            self.finish_current(s, obs, &Outcome::Cancelled, None, now_ms);
        }
        let lazy_prefix = || self.prefix_key();
        let pick = Pick {
            model: self.model.as_deref(),
            session: self.session,
            attempt: self.attempts + 1,
            exclusions: &self.exclusions,
            nonce: self.nonce,
            body_bytes: usize::try_from(self.prompt_bytes).unwrap_or(usize::MAX),
            pin_hint: self.pin_hint,
            holder: self.holder.as_ref().map(|h| h.endpoint_id),
            prefix: match &self.instructions {
                Some(_) => Prefix::Lazy(&lazy_prefix),
                None => Prefix::NONE,
            },
            follow_up: self.follow_up,
            max_output_tokens: self.max_output_tokens,
        };
        let decision = s.pick(&pick, now_ms)?;
        // A session served away from its home (or already carrying a cookie) is told where it
        // now is, so that every replica follows it (see `pin_cookie`).
        self.pin_cookie = self.pin_cookie_for(s, &decision, now_ms);
        self.attempts += 1;
        if self.affinity.is_none() {
            self.affinity = Some(decision.affinity);
        }
        obs.picked(&decision, self.attempts);
        let endpoint = decision.endpoint;
        self.current = Some(Attempt {
            ticket: decision.ticket,
            verdict: None,
            awaits_first_byte: false,
            quota: QuotaHint::default(),
            streamed: false,
            relayed_bytes: 0,
            unmeasured: false,
            pace: Pace::default(),
        });
        Ok(endpoint)
    }

    /// Hands the current attempt's ticket back. `to_headers_ms`: measured at the answer's
    /// headers, else the time until now. Returns the attempt's endpoint.
    pub(super) fn finish_current(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        outcome: &Outcome,
        to_headers_ms: Option<u64>,
        now_ms: u64,
    ) -> Option<usize> {
        let a = self.current.take()?;
        let endpoint = a.ticket.endpoint;
        let total_ms = now_ms.saturating_sub(a.ticket.started_ms);
        let timing = Timing {
            to_headers_ms: (!a.unmeasured).then_some(to_headers_ms.unwrap_or(total_ms)),
            total_ms,
        };
        let report = s.finish_observed(
            a.ticket,
            outcome,
            timing.to_headers_ms,
            self.session,
            &a.quota,
            now_ms,
        );
        self.exclusions.after_attempt(endpoint, outcome);
        obs.finished(endpoint, outcome, &report, timing);
        Some(endpoint)
    }

    /// Finishes the current attempt with the verdict of its answer's headers, or as
    /// `Cancelled` if it had none.
    pub(super) fn finish_by_verdict(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        now_ms: u64,
    ) {
        let verdict = match &self.current {
            Some(a) => a.verdict,
            None => return,
        };
        match verdict {
            Some((outcome, to_headers)) => {
                self.finish_current(s, obs, &outcome, Some(to_headers), now_ms)
            }
            None => self.finish_current(s, obs, &Outcome::Cancelled, None, now_ms),
        };
    }

    /// After an answer (routed or called) whose attempt is finished: fail over if the outcome
    /// and the bounds allow, else conclude with `fallback`.
    pub(super) fn after_answer(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        answered: usize,
        outcome: &Outcome,
        fallback: Fallback,
        now_ms: u64,
    ) -> Step {
        match self.next_attempt(s, obs, answered, outcome, now_ms) {
            Some(i) => {
                self.fallback = Some(fallback);
                self.served_by = Some(i);
                self.phase = Phase::FailingOver;
                Step::Dispatch(i)
            }
            None => self.conclude(s, obs, fallback),
        }
    }

    /// The endpoint of the next attempt, if `outcome` fails over and the attempt limit and
    /// retry budget allow one.
    pub(super) fn next_attempt(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        failed: usize,
        outcome: &Outcome,
        now_ms: u64,
    ) -> Option<usize> {
        if !outcome.fails_over()
            || self.attempts >= s.cfg.max_attempts
            || self.holder_pinned
            || self.body_unread
        {
            return None;
        }
        match self.start_attempt(s, obs, now_ms) {
            Ok(i) => {
                obs.failed_over(failed);
                Some(i)
            }
            Err(NoEndpoint::BudgetExhausted) => {
                obs.budget_exhausted();
                None
            }
            Err(_) => None,
        }
    }

    /// No (further) failover: the client gets the last answer.
    pub(super) fn conclude(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        fallback: Fallback,
    ) -> Step {
        self.phase = Phase::Done;
        // `GET /v1/models` merged with an upstream's list: only a successful list is merged;
        // any other last answer (a 5xx, a 404, a call Envoy refused) gives way to the
        // configured models. The request itself was never routed (it has no cluster): letting
        // it go on would send it nowhere.
        if self.merge_models {
            let listed = matches!(
                &fallback,
                Fallback::Call { status: Some(st), .. } if (200..300).contains(st)
            );
            if !listed {
                return self.answer(200, models::list(s.cfg));
            }
        }
        match fallback {
            Fallback::Routed { served_by } => {
                self.served_by = served_by;
                Step::Relay(self.exposed(s.cfg))
            }
            Fallback::Call {
                served_by,
                status,
                headers,
                body_size,
            } => {
                self.served_by = served_by;
                self.call_answer(s.cfg, obs, status, headers, body_size)
            }
        }
    }

    pub(super) fn refuse(&mut self, obs: &mut dyn Observer, e: &RequestError) -> Step {
        self.reply(obs, e.reply())
    }

    pub(super) fn reply(&mut self, obs: &mut dyn Observer, reply: Reply) -> Step {
        self.phase = Phase::Done;
        obs.replied(&reply);
        Step::Reply(reply)
    }
}

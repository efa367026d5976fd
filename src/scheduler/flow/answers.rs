//! The routed answer's side of a flow: its headers and body judged, a failover call's answer,
//! and the end of the request (Envoy's access-log callback).

use super::*;

impl Flow {
    /// The routed answer's headers.
    pub fn on_response_headers<H: HeaderSource + ?Sized>(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        headers: &H,
        end_of_stream: bool,
        now_ms: u64,
    ) -> Step {
        if self.phase != Phase::Routed {
            return Step::Continue;
        }
        let outcome = match headers.status() {
            // Rate-limit hints matter only on a 429: spare other answers the header reads.
            Some(429) => {
                let hints = rate_limit_hints(headers);
                if hints.is_empty() && !end_of_stream {
                    // No reset hint: is the request too large for any key? Its body says.
                    if let Some(a) = self.current.as_mut() {
                        let to_headers = now_ms.saturating_sub(a.ticket.started_ms);
                        a.verdict = Some((blame::judge_429(&[]), to_headers));
                    }
                    self.phase = Phase::Judging;
                    return Step::Pause;
                }
                classify(429, &hints, now_ms)
            }
            Some(status) => classify(status, &[], now_ms),
            None => Outcome::EndpointFailure(FailureKind::Reset),
        };
        let outcome = blame::by_endpoint(outcome, self.endpoint(s.cfg));
        if outcome.fails_over() {
            if let Some(a) = self.current.as_mut() {
                a.quota = quota_hint(s, &outcome, headers, a.ticket.started_ms);
            }
            let Some(failed) = self.finish_current(s, obs, &outcome, None, now_ms) else {
                return Step::Continue;
            };
            let fallback = Fallback::Routed {
                served_by: self.served_by,
            };
            return self.after_answer(s, obs, failed, &outcome, fallback, now_ms);
        }
        // Relayed: the attempt lasts as long as its answer.
        self.expect_answer(&outcome, headers);
        let streamed = headers
            .header_str("content-type")
            .is_some_and(|ct| api::media_type(&ct) == "text/event-stream");
        if let Some(a) = self.current.as_mut() {
            a.quota = quota_hint(s, &outcome, headers, a.ticket.started_ms);
            let to_headers = now_ms.saturating_sub(a.ticket.started_ms);
            a.verdict = Some((outcome, to_headers));
            // An inference server sends a stream's headers before its prefill: the time to
            // the first token is the time to the first body byte.
            a.awaits_first_byte = streamed && !end_of_stream;
            a.streamed = streamed && !end_of_stream;
        }
        self.phase = Phase::Relaying;
        if matches!(outcome, Outcome::Success) {
            self.scan_usage(s.cfg, headers);
        }
        let mut relayed = self.exposed(s.cfg);
        if let (Outcome::Success, Some(c)) = (&outcome, &self.pin_cookie) {
            relayed.push(("set-cookie", c.clone()));
        }
        let step = Step::Relay(relayed);
        if end_of_stream {
            self.on_response_end(s, obs, now_ms);
        }
        step
    }

    /// Whether the routed answer is held for [`Flow::on_judged_body`].
    pub fn judges_answer(&self) -> bool {
        self.phase == Phase::Judging
    }

    /// The held 429's body: its first bytes (at most `blame::JUDGE_BYTES`), once it ended or
    /// that many arrived. The request's own fault (too large for any key) is relayed as it is
    /// and not held against the endpoint; any other 429 cools the endpoint and fails over as
    /// at the headers. A [`Step::Relay`] lets the held answer go on; a [`Step::Dispatch`]
    /// keeps holding it.
    pub fn on_judged_body(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        head: &[u8],
        now_ms: u64,
    ) -> Step {
        if self.phase != Phase::Judging {
            return Step::Continue;
        }
        let outcome = blame::judge_429(head);
        let to_headers = self.current.as_ref().and_then(|a| a.verdict).map(|v| v.1);
        if outcome.fails_over() {
            self.phase = Phase::Routed;
            let Some(failed) = self.finish_current(s, obs, &outcome, to_headers, now_ms) else {
                return Step::Continue;
            };
            let fallback = Fallback::Routed {
                served_by: self.served_by,
            };
            return self.after_answer(s, obs, failed, &outcome, fallback, now_ms);
        }
        if let Some(a) = self.current.as_mut() {
            a.verdict = Some((outcome, to_headers.unwrap_or(0)));
        }
        self.phase = Phase::Relaying;
        Step::Relay(self.exposed(s.cfg))
    }

    /// The routed answer ended (its last body chunk or its trailers).
    pub fn on_response_end(&mut self, s: &Scheduler<'_>, obs: &mut dyn Observer, now_ms: u64) {
        if self.phase != Phase::Relaying {
            return;
        }
        self.phase = Phase::Done;
        let usage = self.usage.take().and_then(|scan| scan.finish());
        // An affinity hit's answer: its usage teaches the endpoint's payoff, in the same write
        // that finishes the attempt.
        if self.affinity == Some(AffinityResult::Hit) && self.attempts == 1 {
            if let Some(a) = self.current.as_mut() {
                a.ticket.pinned_usage = usage;
                // Did the pin pay: did it find its previous prompt cached?
                let min = s.cfg.payoff_min_prompt_tokens;
                let previous = a.ticket.previous_prompt_tokens;
                if let Some(cold) = usage.and_then(|u| payoff::cold_turn(previous, &u, min)) {
                    obs.pinned_turn(a.ticket.endpoint, cold);
                }
            }
        }
        // The answer, judged against the work it asked for (see `signals`).
        let work_key = signals::work_key(s.cfg, self.model.as_deref());
        let body_bytes = self.body.len() as u64;
        if let Some(a) = self.current.as_mut() {
            a.ticket.served = a.served(usage, body_bytes, work_key, now_ms);
        }
        self.finish_by_verdict(s, obs, now_ms);
        self.admission_done(s, usage.as_ref().map_or(0, |u| u.completion_tokens));
        self.report_usage(obs, usage);
    }

    /// A failover call's answer; `headers` is `None` when the call failed without one
    /// (reset, timeout after headers).
    pub fn on_call_response(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        headers: Option<Pairs>,
        body_size: usize,
        now_ms: u64,
    ) -> Step {
        self.on_call_answer(s, obs, headers, body_size, &[], now_ms)
    }

    /// [`Flow::on_call_response`] with the first bytes of the call's body (at most
    /// `blame::JUDGE_BYTES`; read by the host only for a 429), which tell a request too large
    /// for any key from a rate limit.
    pub fn on_call_answer(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        headers: Option<Pairs>,
        body_size: usize,
        body_head: &[u8],
        now_ms: u64,
    ) -> Step {
        if self.phase != Phase::FailingOver {
            return Step::Continue;
        }
        let status = headers.as_ref().and_then(|h| h.status());
        let outcome = match (status, &headers) {
            (Some(429), Some(h)) => match rate_limit_hints(h) {
                hints if hints.is_empty() => blame::judge_429(body_head),
                hints => classify(429, &hints, now_ms),
            },
            (Some(status), _) => classify(status, &[], now_ms),
            (None, _) => Outcome::EndpointFailure(FailureKind::Reset),
        };
        let outcome = blame::by_endpoint(outcome, self.endpoint(s.cfg));
        if let (Some(a), Some(h)) = (self.current.as_mut(), &headers) {
            a.quota = quota_hint(s, &outcome, h, a.ticket.started_ms);
        }
        // A call's answer arrives whole. A plain one is timed to its end (its headers came
        // with its body: that is its latency), its tokens estimated (its usage is read after
        // the attempt is finished). A stream's first byte cannot be seen: its duration is the
        // generation's, so it is no latency sample and not judged for slowness (a
        // 20 s stream once became a 20 s sample, and the backup was degraded for it).
        let streamed = headers
            .as_ref()
            .and_then(|h| h.header_str("content-type"))
            .is_some_and(|ct| api::media_type(&ct) == "text/event-stream");
        if streamed {
            if let Some(a) = self.current.as_mut() {
                a.unmeasured = true;
            }
        } else if matches!(outcome, Outcome::Success) {
            let work_key = signals::work_key(s.cfg, self.model.as_deref());
            let body_bytes = self.body.len() as u64;
            if let Some(a) = self.current.as_mut() {
                a.ticket.served = Some(Served {
                    streamed: false,
                    observed_ms: now_ms.saturating_sub(a.ticket.started_ms),
                    decode_ms: None,
                    decode_bytes: None,
                    usage: None,
                    body_bytes,
                    relayed_bytes: body_size as u64,
                    work_key,
                });
            }
        }
        let Some(answered) = self.finish_current(s, obs, &outcome, None, now_ms) else {
            return Step::Continue;
        };
        if let Some(h) = &headers {
            self.expect_answer(&outcome, h);
        }
        let fallback = Fallback::Call {
            served_by: Some(answered),
            status,
            headers: headers.unwrap_or_default(),
            body_size,
        };
        self.after_answer(s, obs, answered, &outcome, fallback, now_ms)
    }

    /// The host refused the failover call of the last [`Step::Dispatch`]. Envoy refuses a
    /// call whose cluster it does not know — a connect failure of that endpoint; the next one
    /// is tried — and one whose request lacks `:method`, `:path` or `:authority` (e.g. an
    /// HTTP/1.0 request without `Host`), whatever the cluster: the request's own fault, not
    /// charged to the endpoint, and not tried elsewhere (every call would be
    /// refused alike).
    pub fn dispatch_failed(
        &mut self,
        s: &Scheduler<'_>,
        obs: &mut dyn Observer,
        now_ms: u64,
    ) -> Step {
        let unsendable = [":method", ":path", ":authority"]
            .iter()
            .any(|h| self.headers.header(h).is_none_or(|v| v.is_empty()));
        let outcome = if unsendable {
            Outcome::ClientError
        } else {
            Outcome::EndpointFailure(FailureKind::ConnectFailure)
        };
        let Some(failed) = self.finish_current(s, obs, &outcome, None, now_ms) else {
            return Step::Continue;
        };
        let fallback = self.fallback.take().unwrap_or(Fallback::Routed {
            served_by: self.served_by,
        });
        self.after_answer(s, obs, failed, &outcome, fallback, now_ms)
    }

    /// The request is over (Envoy's access-log callback, which runs in every case).
    pub fn on_log(&mut self, s: &Scheduler<'_>, obs: &mut dyn Observer, now_ms: u64) {
        self.leave_queue(s, obs, now_ms);
        self.admission_done(s, 0);
        // An answer that never ended (cut, client gone) reports no usage.
        self.usage = None;
        self.finish_by_verdict(s, obs, now_ms);
        self.phase = Phase::Done;
    }
}

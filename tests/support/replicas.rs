//! Replicas of the gateway: several Envoy processes with the same configuration in front of the
//! same upstreams, as the Envoy pods of one Deployment behind a load balancer.
//!
//! Why: an Envoy process keeps the filter's memory (pins, latency estimates, breakers) in its own
//! shared data; replicas share none of it and a restarted one starts empty. Replica-consistent
//! placement can only be shown with several processes and restarts.
//!
//! How: each replica is an [`Envoy`] with its own port-0 listener and admin port. The client
//! chooses the replica per request (client-side round-robin, or one replica on purpose), which
//! is what a load balancer in front of them does, minus the choice being visible. A restart stops
//! the process by its PID (the [`Envoy`] handle's drop kills and reaps its child) and starts a
//! new one from the same [`EnvoyConfig`]: empty shared data, possibly other ports. Every replica
//! is stopped when the [`Replicas`] drop, also when a test panics.

use super::envoy::{Envoy, EnvoyConfig};

pub struct Replicas {
    cfg: EnvoyConfig,
    envoys: Vec<Envoy>,
}

impl Replicas {
    /// Starts `count` Envoys from `cfg`, one after the other (each waits until ready).
    pub fn start(cfg: EnvoyConfig, count: usize) -> Replicas {
        assert!(count > 0, "at least one replica");
        let envoys = (0..count).map(|_| Envoy::start(cfg.clone())).collect();
        Replicas { cfg, envoys }
    }

    pub fn len(&self) -> usize {
        self.envoys.len()
    }

    pub fn envoy(&self, replica: usize) -> &Envoy {
        &self.envoys[replica]
    }

    pub fn envoys(&self) -> &[Envoy] {
        &self.envoys
    }

    /// The listener port of `replica`.
    pub fn port(&self, replica: usize) -> u16 {
        self.envoys[replica].port
    }

    /// The replica that serves the `n`-th request of a round-robin sequence.
    pub fn round_robin(&self, n: usize) -> usize {
        n % self.envoys.len()
    }

    /// Stops `replica` (by its PID) and starts a fresh Envoy from the same configuration in its
    /// place, with empty shared data. Returns the old and the new PID.
    pub fn restart(&mut self, replica: usize) -> (u32, u32) {
        let old_pid = self.envoys[replica].pid();
        // Stop first, start after: like a pod replaced on a rollout, never both at once.
        drop(self.envoys.remove(replica));
        let fresh = Envoy::start(self.cfg.clone());
        let new_pid = fresh.pid();
        self.envoys.insert(replica, fresh);
        (old_pid, new_pid)
    }

    /// Lines of the replicas' Envoy logs that show a wasm panic or VM failure, prefixed with the
    /// replica index (empty when none crashed).
    pub fn wasm_crashes(&self) -> Vec<String> {
        self.envoys
            .iter()
            .enumerate()
            .flat_map(|(i, e)| {
                e.wasm_crashes()
                    .into_iter()
                    .map(move |l| format!("replica {i}: {l}"))
            })
            .collect()
    }
}

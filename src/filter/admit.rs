//! The admission round on the root context's timer: admit from the process's queue while
//! the fleet has room, then route and resume (or answer) this VM's admitted requests.
//!
//! Each worker VM runs a round every [`ADMISSION_TICK`] while it has requests paused. A round
//! admits the best-ranked waiting requests of any VM (so the order is the process's, not the
//! worker's), but only the VM that paused a request can resume it: another VM's admitted entry
//! stays marked (holding its slot) until its owner's next round takes it.

use super::host;
use super::http::{perform, run};
use super::parked::Parked;
use super::plugin::Plugin;
use super::shared::SharedData;
use crate::scheduler::admission::{self, fleet};
use crate::scheduler::flow::admit::rule;
use crate::scheduler::routing::select::Scheduler;
use proxy_wasm::types::Action;

pub use super::parked::ADMISSION_TICK;

/// One admission round for this VM. Returns whether requests of this VM still wait.
pub fn round(plugin: &Plugin, parked: &Parked<Plugin>, now_ms: u64) -> bool {
    if parked.is_empty() {
        return false;
    }
    let store = SharedData;
    let sched =
        Scheduler::with_caches(&plugin.cfg, &store, &plugin.table_cache, &plugin.rooms_memo);
    let (deliveries, queue) = admission::tick(
        &store,
        plugin.vm,
        &rule(&plugin.cfg),
        now_ms,
        |m| fleet::room_by_key(&sched, m, now_ms),
        |m| fleet::shared_by_key(&sched, m, now_ms),
    );
    for d in deliveries {
        let Some(slot) = parked.take(d.ctx) else {
            continue;
        };
        let Ok(mut flow) = slot.flow.try_borrow_mut() else {
            continue;
        };
        // The stream is gone (it ended while its entry was decided): nothing to resume.
        if !host::set_effective_context(d.ctx) {
            continue;
        }
        let p = &slot.plugin;
        let step = run(p, &mut flow, now_ms, |f, s, r| match d.refused {
            None => f.on_admitted(s, r, d.waited_ms, now_ms),
            Some(why) => f.on_refused(&p.cfg, r, why, d.waited_ms),
        });
        if perform(p, &mut flow, step, now_ms) == Action::Continue {
            host::resume_request();
        }
    }
    plugin.metrics.admission_gauges(&queue);
    !parked.is_empty() || queue.has(plugin.vm)
}

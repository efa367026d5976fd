//! The requests of this VM paused for admission, reachable from the root context's timer.
//!
//! Why: Envoy resumes a paused request only through the VM that paused it, and the only code
//! of a VM that runs without a request callback is its root context's tick. A paused request's
//! [`Flow`] moves here when it starts waiting, so that the tick can route it when the queue
//! admits it (its `Step` performed on the request with `set_effective_context`) before
//! resuming it; the request's own context takes it back at its next callback.

use crate::scheduler::flow::Flow;
use std::cell::RefCell;
use std::rc::Rc;

/// The root context's timer period while requests of this VM wait (admission rounds).
pub const ADMISSION_TICK: std::time::Duration = std::time::Duration::from_millis(5);

/// A paused request: its flow and the plugin (configuration, `P`) it started under.
pub struct Slot<P> {
    pub flow: Rc<RefCell<Flow>>,
    pub plugin: Rc<P>,
}

/// This VM's paused requests by context id (one per waiting request of this worker; bounded
/// by the queue's bound, as a request is refused rather than queued past it).
pub struct Parked<P> {
    slots: RefCell<Vec<(u32, Slot<P>)>>,
}

impl<P> Default for Parked<P> {
    fn default() -> Self {
        Parked {
            slots: RefCell::new(Vec::new()),
        }
    }
}

impl<P> Parked<P> {
    pub fn park(&self, ctx: u32, slot: Slot<P>) {
        if let Ok(mut s) = self.slots.try_borrow_mut() {
            s.retain(|(c, _)| *c != ctx);
            s.push((ctx, slot));
        }
    }

    /// Takes the slot of `ctx` out, if parked.
    pub fn take(&self, ctx: u32) -> Option<Slot<P>> {
        let mut s = self.slots.try_borrow_mut().ok()?;
        let at = s.iter().position(|(c, _)| *c == ctx)?;
        Some(s.swap_remove(at).1)
    }

    pub fn is_empty(&self) -> bool {
        self.slots.try_borrow().map_or(true, |s| s.is_empty())
    }
}

//! The scheduler's [`Store`] over Envoy shared data (one copy per Envoy process, shared by the
//! VMs of every worker thread with this plugin's `vm_id`; CAS is atomic across them).

use crate::scheduler::store::{CasMismatch, Store};
use proxy_wasm::hostcalls;

pub struct SharedData;

impl Store for SharedData {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        hostcalls::get_shared_data(key).unwrap_or((None, None))
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        hostcalls::set_shared_data(key, Some(value), cas).map_err(|_| CasMismatch)
    }
}

//! The scheduler's [`Store`] over Envoy shared data (one copy per Envoy process, shared by the
//! VMs of every worker thread with this plugin's `vm_id`; CAS is atomic across them).

use super::host;
use crate::scheduler::state::store::{CasMismatch, Store};

pub struct SharedData;

impl Store for SharedData {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, Option<u32>) {
        host::shared_get(key)
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        host::shared_set(key, value, cas)
    }
}

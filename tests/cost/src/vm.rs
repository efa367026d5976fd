//! One plugin VM: the module instantiated under wasmtime with fuel metering, and the
//! proxy-wasm callbacks Envoy makes, each returning the fuel (instructions) it consumed.
//!
//! Fuel: wasmtime charges one unit per executed wasm operator (none for `nop`, `drop`,
//! `block`, `loop`, `end`, `else`, `return`, `unreachable`). The count depends only on the
//! module and its inputs, never on the machine or the compiler's code, so it is exact and
//! repeatable. Work the module does inside a host call (its `proxy_on_memory_allocate` run by
//! the host to hand it a buffer) is counted in the callback that made the call.

use crate::host::{self, Host};
use std::collections::BTreeMap;
use wasmtime::{bail, Config, Engine, Instance, Linker, Module, Store, TypedFunc};

/// Fuel given at start; far more than any run uses.
pub const FUEL: u64 = u64::MAX / 2;

/// The compiled module, shared by every VM of the same `.wasm`.
pub struct Loaded {
    pub engine: Engine,
    module: Module,
    linker: Linker<Host>,
    /// Stacks are sampled at epoch ticks (`--profile`); fuel is counted the same.
    profiling: bool,
}

impl Loaded {
    pub fn new(wasm: &[u8]) -> wasmtime::Result<Loaded> {
        Loaded::with(wasm, false)
    }

    /// For `--profile`: epoch interruption on, so that a thread ticking the engine's epoch
    /// makes every VM of this module record its wasm stack (when its host is `sampling`).
    pub fn profiling(wasm: &[u8]) -> wasmtime::Result<Loaded> {
        Loaded::with(wasm, true)
    }

    fn with(wasm: &[u8], profiling: bool) -> wasmtime::Result<Loaded> {
        let mut config = Config::new();
        config.consume_fuel(true);
        config.epoch_interruption(profiling);
        // Fuel counts wasm operators, whatever machine code they become: skip cranelift's
        // optimisations, which only slow the compile (a debug build of cranelift compiles the
        // filter in about a minute on a busy 2-core machine otherwise).
        config.cranelift_opt_level(wasmtime::OptLevel::None);
        let engine = Engine::new(&config)?;
        let module = Module::new(&engine, wasm)?;
        let mut linker = Linker::new(&engine);
        host::link(&mut linker, &module)?;
        Ok(Loaded {
            engine,
            module,
            linker,
            profiling,
        })
    }
}

/// Fuel per callback name, accumulated.
pub type Fuel = BTreeMap<&'static str, u64>;

pub struct Vm {
    pub store: Store<Host>,
    instance: Instance,
    /// Fuel per callback kind since the VM started.
    pub fuel: Fuel,
}

impl Vm {
    pub fn new(loaded: &Loaded) -> wasmtime::Result<Vm> {
        let mut store = Store::new(&loaded.engine, Host::default());
        store.set_fuel(FUEL)?;
        if loaded.profiling {
            store.set_epoch_deadline(1);
            store.epoch_deadline_callback(|mut ctx| {
                if ctx.data().sampling {
                    let trace = wasmtime::WasmBacktrace::capture(&ctx);
                    let stack: Vec<String> = trace
                        .frames()
                        .iter()
                        .map(|f| {
                            f.func_name()
                                .map_or_else(|| format!("#{}", f.func_index()), str::to_string)
                        })
                        .collect();
                    *ctx.data_mut().samples.entry(stack).or_insert(0) += 1;
                }
                Ok(wasmtime::UpdateDeadline::Continue(1))
            });
        }
        let instance = loaded.linker.instantiate(&mut store, &loaded.module)?;
        let mut vm = Vm {
            store,
            instance,
            fuel: Fuel::new(),
        };
        // A wasip1 reactor initialises its runtime in `_initialize`, as Envoy calls it.
        if vm.instance.get_func(&mut vm.store, "_initialize").is_some() {
            vm.call::<(), ()>("_initialize", ())?;
        }
        Ok(vm)
    }

    pub fn fuel_used(&self) -> wasmtime::Result<u64> {
        Ok(FUEL - self.store.get_fuel()?)
    }

    fn call<P, R>(&mut self, name: &'static str, params: P) -> wasmtime::Result<R>
    where
        P: wasmtime::WasmParams,
        R: wasmtime::WasmResults,
    {
        let f: TypedFunc<P, R> = match self.instance.get_typed_func(&mut self.store, name) {
            Ok(f) => f,
            Err(e) => bail!("export {name}: {e}"),
        };
        let before = self.fuel_used()?;
        if self.store.data().echo {
            eprintln!("[call {name} fuel {before}]");
        }
        let out = f.call(&mut self.store, params)?;
        let used = self.fuel_used()? - before;
        *self.fuel.entry(name).or_insert(0) += used;
        Ok(out)
    }

    pub fn host(&mut self) -> &mut Host {
        self.store.data_mut()
    }

    pub fn context_create(&mut self, ctx: u32, parent: u32) -> wasmtime::Result<()> {
        self.call::<(i32, i32), ()>("proxy_on_context_create", (ctx as i32, parent as i32))
    }

    pub fn vm_start(&mut self, root: u32) -> wasmtime::Result<bool> {
        let n = self.host().buffers[host::BUF_VM_CONFIGURATION].len() as i32;
        Ok(self.call::<(i32, i32), i32>("proxy_on_vm_start", (root as i32, n))? != 0)
    }

    pub fn configure(&mut self, root: u32) -> wasmtime::Result<bool> {
        let n = self.host().buffers[host::BUF_PLUGIN_CONFIGURATION].len() as i32;
        Ok(self.call::<(i32, i32), i32>("proxy_on_configure", (root as i32, n))? != 0)
    }

    pub fn tick(&mut self, root: u32) -> wasmtime::Result<()> {
        self.call::<i32, ()>("proxy_on_tick", root as i32)
    }

    /// Returns true for `Continue`, false for `Pause`.
    pub fn request_headers(&mut self, ctx: u32, eos: bool) -> wasmtime::Result<bool> {
        let n = self.host().maps[host::MAP_REQUEST_HEADERS].len() as i32;
        let a = self.call::<(i32, i32, i32), i32>(
            "proxy_on_request_headers",
            (ctx as i32, n, eos as i32),
        )?;
        Ok(a == 0)
    }

    pub fn request_body(&mut self, ctx: u32, size: usize, eos: bool) -> wasmtime::Result<bool> {
        let a = self.call::<(i32, i32, i32), i32>(
            "proxy_on_request_body",
            (ctx as i32, size as i32, eos as i32),
        )?;
        Ok(a == 0)
    }

    pub fn response_headers(&mut self, ctx: u32, eos: bool) -> wasmtime::Result<bool> {
        let n = self.host().maps[host::MAP_RESPONSE_HEADERS].len() as i32;
        let a = self.call::<(i32, i32, i32), i32>(
            "proxy_on_response_headers",
            (ctx as i32, n, eos as i32),
        )?;
        Ok(a == 0)
    }

    pub fn response_body(&mut self, ctx: u32, size: usize, eos: bool) -> wasmtime::Result<bool> {
        let a = self.call::<(i32, i32, i32), i32>(
            "proxy_on_response_body",
            (ctx as i32, size as i32, eos as i32),
        )?;
        Ok(a == 0)
    }

    pub fn http_call_response(
        &mut self,
        ctx: u32,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) -> wasmtime::Result<()> {
        self.call::<(i32, i32, i32, i32, i32), ()>(
            "proxy_on_http_call_response",
            (
                ctx as i32,
                token as i32,
                num_headers as i32,
                body_size as i32,
                0,
            ),
        )
    }

    pub fn log(&mut self, ctx: u32) -> wasmtime::Result<()> {
        self.call::<i32, ()>("proxy_on_log", ctx as i32)
    }

    pub fn done(&mut self, ctx: u32) -> wasmtime::Result<bool> {
        Ok(self.call::<i32, i32>("proxy_on_done", ctx as i32)? != 0)
    }

    pub fn delete(&mut self, ctx: u32) -> wasmtime::Result<()> {
        self.call::<i32, ()>("proxy_on_delete", ctx as i32)
    }
}

//! Which engine a page comes from: the engines whose `/metrics` formats are read, each with a
//! stable code for the shared-data codec and its label name.

use super::Format;

/// The engine a configured format names (`None`: detect it).
pub(super) fn engine_of(format: Format) -> Option<Engine> {
    match format {
        Format::Vllm => Some(Engine::Vllm),
        Format::Sglang => Some(Engine::Sglang),
        Format::Llamacpp => Some(Engine::Llamacpp),
        Format::Tgi => Some(Engine::Tgi),
        Format::Auto => None,
    }
}

/// The engine whose metrics were read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Vllm,
    Sglang,
    Llamacpp,
    Tgi,
}

impl Engine {
    pub const ALL: [Engine; 4] = [Engine::Vllm, Engine::Sglang, Engine::Llamacpp, Engine::Tgi];

    /// A stable one-byte code (used by the shared-data codec in `scrape.rs`).
    pub fn code(self) -> u8 {
        match self {
            Engine::Vllm => 1,
            Engine::Sglang => 2,
            Engine::Llamacpp => 3,
            Engine::Tgi => 4,
        }
    }

    pub fn from_code(code: u8) -> Option<Engine> {
        Engine::ALL.into_iter().find(|e| e.code() == code)
    }

    pub fn name(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Llamacpp => "llamacpp",
            Engine::Tgi => "tgi",
        }
    }
}

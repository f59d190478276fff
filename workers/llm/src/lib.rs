//! The LLM tools family: tools declared in a definition file alone
//! (`systemPrompt`, `userTemplate`, `outputFormat`, `variants`,
//! `modelPreference`) and run against the fleet's model deployments.
//!
//! **Work in progress (issue 11).** What is here is the declarative core,
//! checked and tested on its own:
//!
//! - [`prompt`]: the prompt of a definition (or one of its variants),
//!   compiled once — a `userTemplate` naming a variable the input schema
//!   lacks is refused with the file and field — and rendered from the
//!   validated arguments with the schema's defaults filled in;
//! - [`variant`]: which variant serves a `provider/model`;
//! - [`reply`]: a `json` tool's reply, code fences stripped, or an error
//!   quoting what came back;
//! - [`models`]: the order in which models are tried.
//!
//! Not yet: the tool that calls the models (with fallback hooks and usage
//! reported through `ToolCtx::record_llm_call`), the binary, the built-in
//! definitions.

pub mod models;
pub mod prompt;
pub mod reply;
pub mod variant;

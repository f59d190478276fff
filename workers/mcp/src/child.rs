//! A stdio MCP server's process, started so that it cannot reach the
//! worker's credentials:
//!
//! - **an explicit environment**: `PATH`, `HOME`, `LANG`, `LC_ALL`,
//!   `TMPDIR`, then what the server's `pass_env`, `env` and `env_files`
//!   name, and `TOOLFLEET_TENANT` for a `per_tenant` child — never the
//!   worker's own variables;
//! - **no credential left in the worker's start-up environment**: before
//!   its runtime starts, the worker moves its environment to the heap and
//!   zeroes the block the kernel shows as `/proc/<pid>/environ`
//!   ([`hide_start_environment`]), so even a child that may read the
//!   worker's memory (root, `CAP_SYS_PTRACE`) finds no variable there;
//! - **the worker's memory closed**: before its first child the worker
//!   makes itself non-dumpable ([`protect_worker`]), so a process of the
//!   same user cannot read its `/proc/<pid>/environ`, `mem` or open files;
//! - **another user**: `run_as = { uid, gid }` runs the child as that user
//!   and group (supplementary groups dropped), so it cannot read the
//!   worker's files either;
//! - **stderr scrubbed**: what the child writes on stderr is logged line by
//!   line through the worker's scrubber (its own secrets, the child's
//!   `env_files` and `pass_env` values), never passed through raw.

use std::path::Path;
use std::sync::Once;

use tokio::io::AsyncBufReadExt;
use toolfleet_worker::Secret;
use toolfleet_worker::settings::Scrubber;

use crate::config::ServerSpec;

/// The variables every child gets from the worker's environment (none of
/// them a credential).
pub const BASE_ENV: [&str; 5] = ["PATH", "HOME", "LANG", "LC_ALL", "TMPDIR"];
/// The variable a `per_tenant` child finds its tenant in.
pub const TENANT_ENV: &str = "TOOLFLEET_TENANT";
/// The longest stderr line logged whole (longer ones are cut).
const MAX_STDERR_LINE: usize = 2000;

/// Empties what the kernel shows as the worker's `/proc/<pid>/environ`,
/// keeping every variable for the worker itself: each is copied, removed
/// and set again (now on the heap), then the start-up block the kernel
/// reads (`env_start..env_end` of `/proc/self/stat`) is overwritten with
/// zeros through `/proc/self/mem`. Call it first in `main`, before any
/// thread starts (the runtime included): changing the environment is sound
/// only while the process has one thread. Returns why it could not (not
/// Linux, no `/proc`): the worker then relies on [`protect_worker`] alone.
///
/// # Errors
///
/// `/proc/self/stat` or `/proc/self/mem` cannot be read or written.
#[allow(unsafe_code)]
pub fn hide_start_environment() -> Result<(), String> {
    let (start, end) = env_block()?;
    let vars: Vec<(std::ffi::OsString, std::ffi::OsString)> = std::env::vars_os().collect();
    for (name, _) in &vars {
        // SAFETY: called first in `main`, before any other thread exists,
        // so no one reads the environment while it changes.
        unsafe { std::env::remove_var(name) };
    }
    let zeroed = zero_memory(start, end);
    for (name, value) in &vars {
        // SAFETY: as above; the copies now live on the heap, outside the
        // block the kernel shows.
        unsafe { std::env::set_var(name, value) };
    }
    zeroed
}

/// The start-up environment block's addresses (`env_start`, `env_end`:
/// fields 50 and 51 of `/proc/self/stat`, after the command in brackets).
fn env_block() -> Result<(u64, u64), String> {
    let stat = std::fs::read_to_string("/proc/self/stat")
        .map_err(|e| format!("cannot read /proc/self/stat: {e}"))?;
    let after = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or("/proc/self/stat has no command")?;
    // Field 3 is the first after the command: env_start is field 50.
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| {
        fields
            .get(n - 3)
            .and_then(|f| f.parse::<u64>().ok())
            .ok_or_else(|| format!("/proc/self/stat has no field {n}"))
    };
    let (start, end) = (field(50)?, field(51)?);
    if start == 0 || end < start {
        return Err(format!(
            "/proc/self/stat: no environment block ({start}..{end})"
        ));
    }
    Ok((start, end))
}

/// Writes zeros over `start..end` of this process's memory.
fn zero_memory(start: u64, end: u64) -> Result<(), String> {
    use std::io::{Seek, SeekFrom, Write};
    let mut mem = std::fs::OpenOptions::new()
        .write(true)
        .open("/proc/self/mem")
        .map_err(|e| format!("cannot open /proc/self/mem: {e}"))?;
    let len = usize::try_from(end - start).map_err(|e| e.to_string())?;
    mem.seek(SeekFrom::Start(start))
        .and_then(|_| mem.write_all(&vec![0; len]))
        .map_err(|e| format!("cannot zero the start-up environment: {e}"))
}

/// Makes the worker non-dumpable (once): its `/proc/<pid>/environ`, `mem`
/// and `fd` become unreadable to every process without `CAP_SYS_PTRACE`,
/// the MCP children of the same user included. Logged when it fails (not
/// Linux): the children still get no credential in their environment.
pub fn protect_worker() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if let Err(e) =
            rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
        {
            tracing::warn!(error = %e, "cannot make the worker non-dumpable: its children of the same user may read /proc/<worker>/environ");
        }
    });
}

/// A child to start: the command, and the secrets it was given (what its
/// stderr is scrubbed of, besides the worker's own).
pub struct Prepared {
    pub command: tokio::process::Command,
    pub secrets: Vec<Secret>,
}

/// The command of `spec`'s child (for `tenant`, when per tenant).
///
/// # Errors
///
/// An `env_files` file that cannot be read (named, never its content).
pub fn prepare(
    spec: &ServerSpec,
    program: &str,
    args: &[String],
    tenant: Option<&str>,
) -> Result<Prepared, String> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).env_clear().kill_on_drop(true);
    for keep in BASE_ENV {
        if let Ok(v) = std::env::var(keep) {
            cmd.env(keep, v);
        }
    }
    let mut secrets = Vec::new();
    for name in &spec.pass_env {
        if let Ok(v) = std::env::var(name) {
            secrets.push(Secret::new(v.clone()));
            cmd.env(name, v);
        }
    }
    cmd.envs(&spec.env);
    for (name, path) in &spec.env_files {
        let value = read_secret(path).map_err(|e| format!("env_files {name}: {e}"))?;
        secrets.push(Secret::new(value.clone()));
        cmd.env(name, value);
    }
    if let Some(tenant) = tenant {
        cmd.env(TENANT_ENV, tenant);
    }
    if let Some(dir) = &spec.cwd {
        cmd.current_dir(dir);
    }
    if let Some(run_as) = spec.run_as {
        cmd.uid(run_as.uid).gid(run_as.gid);
    }
    Ok(Prepared {
        command: cmd,
        secrets,
    })
}

/// A secret file's content, without its trailing newline.
///
/// # Errors
///
/// The file cannot be read (the message names the file, not a value).
pub fn read_secret(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim_end_matches(['\n', '\r']).to_string())
        .map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// Logs `stderr` line by line, each scrubbed of `scrubber`'s secrets,
/// until the child closes it.
pub fn log_stderr(
    stderr: tokio::process::ChildStderr,
    scrubber: Scrubber,
    server: String,
    tenant: Option<String>,
) {
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            let mut line = scrubber.text(&line);
            if line.len() > MAX_STDERR_LINE {
                let cut = (0..=MAX_STDERR_LINE)
                    .rev()
                    .find(|i| line.is_char_boundary(*i))
                    .unwrap_or(0);
                line.truncate(cut);
                line.push('…');
            }
            tracing::info!(
                server = %server,
                tenant = tenant.as_deref().unwrap_or("-"),
                "MCP server stderr: {line}"
            );
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_gets_an_explicit_environment_with_secrets_from_files() {
        let dir = tempfile_dir();
        let token = dir.join("token");
        std::fs::write(&token, "file-secret-1234\n").unwrap();
        let spec: ServerSpec = toml::from_str(&format!(
            "command = [\"x\"]\nenv = {{ A = \"1\" }}\nenv_files = {{ T = \"{}\" }}\nrun_as = {{ uid = 65534, gid = 65534 }}\n",
            token.display()
        ))
        .unwrap();
        let prepared = prepare(&spec, "x", &[], Some("acme")).unwrap();
        let cmd = prepared.command.as_std();
        let env: Vec<(String, Option<String>)> = cmd
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        assert!(env.contains(&("T".into(), Some("file-secret-1234".into()))));
        assert!(env.contains(&("A".into(), Some("1".into()))));
        assert!(env.contains(&(TENANT_ENV.into(), Some("acme".into()))));
        assert!(
            env.iter().all(|(k, _)| BASE_ENV.contains(&k.as_str())
                || ["T", "A", TENANT_ENV].contains(&k.as_str())),
            "{env:?}"
        );
        assert_eq!(prepared.secrets, [Secret::new("file-secret-1234")]);
        let missing: ServerSpec =
            toml::from_str("command = [\"x\"]\nenv_files = { T = \"/nonexistent/t\" }\n").unwrap();
        let e = prepare(&missing, "x", &[], None).err().unwrap();
        assert!(e.contains("env_files T: cannot read /nonexistent/t"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_start_up_environment_block_is_found() {
        let (start, end) = env_block().unwrap();
        assert!(end > start);
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("toolfleet-mcp-child-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}

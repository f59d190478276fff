//! toolfleet-build: `revision!()`, the git revision a binary was built
//! from, as a `&'static str` expression.
//!
//! # Why a macro, not a build script
//!
//! A build script's output is an input of every target of its package and
//! of every crate that depends on that package, so a build script that
//! reads `.git` would recompile the whole workspace at every commit (Cargo
//! has no dependency of one target only). The macro instead expands, in the
//! crate that calls it, to
//!
//! - `include_bytes!` of the git files a commit, a checkout or a reset
//!   changes (`HEAD`, its reflog, the branch's ref, `packed-refs`), as
//!   unused constants: rustc lists them in that crate's dep-info, so Cargo
//!   recompiles that crate, and only it, when they change;
//! - `option_env!("TOOLFLEET_GIT_REVISION")`, which rustc tracks the same
//!   way: builds without `.git` (a Docker context) pass the revision in it;
//! - else the revision `git rev-parse --short=12 HEAD` gave at expansion,
//!   or `"unknown"` where there is no git or no repository.
//!
//! Only the binaries' `main.rs` call it (through
//! `toolfleet_service::build_info!`): a commit relinks the binaries, and
//! the libraries keep their compiled code.
//!
//! # Layout
//!
//! - [`revision!`]: the macro; `expansion` builds its code from what git
//!   said, so the code is tested without git.

use std::path::{Path, PathBuf};
use std::process::Command;

use proc_macro::TokenStream;

/// The variable a build without `.git` sets to the revision (an empty value
/// counts as unset).
const ENV_REVISION: &str = "TOOLFLEET_GIT_REVISION";

/// What a build outside any git repository says.
const UNKNOWN: &str = "unknown";

/// The git revision this crate is built from, as a `&'static str`
/// expression usable in a `const`: `TOOLFLEET_GIT_REVISION` when set and
/// not empty, else the abbreviated commit id (12 hex digits at least), else
/// `"unknown"`. The crate that expands it is recompiled when the commit
/// or the variable changes.
#[proc_macro]
pub fn revision(input: TokenStream) -> TokenStream {
    if !input.is_empty() {
        return r#"::core::compile_error!("revision!() takes no arguments")"#
            .parse()
            .unwrap_or_default();
    }
    // Given the variable, git is not asked: the expansion reads it again
    // through `option_env!`, which makes rustc track it.
    let given = std::env::var(ENV_REVISION).is_ok_and(|v| !v.is_empty());
    let dir = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(|| PathBuf::from("."), Into::into);
    let (revision, watched) = if given {
        (UNKNOWN.to_owned(), Vec::new())
    } else {
        from_git(&dir)
    };
    expansion(&revision, &watched).parse().unwrap_or_default()
}

/// The revision of the repository holding `dir`, and the files that change
/// with it; `"unknown"` and none without git or a repository.
fn from_git(dir: &Path) -> (String, Vec<PathBuf>) {
    let Some(revision) = git(dir, &["rev-parse", "--short=12", "HEAD"]) else {
        return (UNKNOWN.to_owned(), Vec::new());
    };
    let mut names = vec![
        "HEAD".to_owned(),
        "logs/HEAD".to_owned(),
        "packed-refs".to_owned(),
    ];
    // The branch's own ref (refs/heads/main), absent for a detached HEAD.
    if let Some(branch) = git(dir, &["symbolic-ref", "-q", "HEAD"]) {
        names.push(format!("logs/{branch}"));
        names.push(branch);
    }
    // `--git-path` knows worktrees; its answer may be relative to `dir`.
    let watched = names
        .iter()
        .filter_map(|name| git(dir, &["rev-parse", "--git-path", name]))
        .filter_map(|path| dir.join(path).canonicalize().ok())
        .filter(|path| path.is_file())
        .collect();
    (revision, watched)
}

/// What `git -C dir args` prints, trimmed, when it succeeds.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (out.status.success() && !text.is_empty()).then(|| text.to_owned())
}

/// The macro's code: a block that depends on `watched` and on the
/// variable, and is the variable's value or else `revision`.
fn expansion(revision: &str, watched: &[PathBuf]) -> String {
    let mut code = String::from("{ ");
    for path in watched {
        // A path rustc cannot read as a literal is left unwatched.
        if let Some(path) = path.to_str() {
            code.push_str(&format!(
                "const _: &[u8] = ::core::include_bytes!({path:?}); "
            ));
        }
    }
    code.push_str(&format!(
        "match ::core::option_env!({ENV_REVISION:?}) {{ \
         ::core::option::Option::Some(r) if !r.is_empty() => r, _ => {revision:?} }} }}"
    ));
    code
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expansion_watches_the_files_and_prefers_the_variable() {
        let code = expansion("0123456789ab", &[PathBuf::from("/r/.git/logs/HEAD")]);
        assert_eq!(
            code,
            "{ const _: &[u8] = ::core::include_bytes!(\"/r/.git/logs/HEAD\"); \
             match ::core::option_env!(\"TOOLFLEET_GIT_REVISION\") { \
             ::core::option::Option::Some(r) if !r.is_empty() => r, _ => \"0123456789ab\" } }"
        );
    }

    #[test]
    fn git_gives_the_commit_and_its_files() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        if git(here, &["rev-parse", "HEAD"]).is_none() {
            // A source tree without git (a packaged crate): nothing to see.
            return;
        }
        let (revision, watched) = from_git(here);
        assert!(
            revision.len() >= 12 && revision.chars().all(|c| c.is_ascii_hexdigit()),
            "{revision}"
        );
        assert!(watched.iter().any(|p| p.ends_with("HEAD")), "{watched:?}");
        assert!(watched.iter().all(|p| p.is_absolute()), "{watched:?}");
    }

    #[test]
    fn a_repository_without_a_commit_is_unknown() {
        let dir = std::env::temp_dir().join(format!("toolfleet-build-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // `git init -q` prints nothing, so `git` says None: look instead.
        let _ = git(&dir, &["init", "-q"]);
        let made = dir.join(".git").is_dir();
        let found = from_git(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(made, "git init in {}", dir.display());
        assert_eq!(found, (UNKNOWN.to_owned(), Vec::new()));
    }
}

//! What this process is: the workspace's version and the git revision it
//! was built from, for `--version`, `toolfleet_build_info`, the services
//! API and traces.
//!
//! The revision is read where a binary's `main` expands [`build_info!`]
//! (the `toolfleet-build` macro, which recompiles that `main.rs` alone at a
//! commit) and handed to the libraries once at start-up with [`set`]; a
//! library asks [`get`]. A process that never called [`set`] (a test, an
//! embedding program) has the workspace's version and the revision
//! `unknown`.

use std::sync::OnceLock;

pub use toolfleet_build::revision;

/// The revision of a build that knows none (no `.git`, no
/// `TOOLFLEET_GIT_REVISION`), or of a process that never called [`set`].
pub const UNKNOWN_REVISION: &str = "unknown";

/// A binary's version and git revision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BuildInfo {
    /// The package version (the workspace's: every package has it).
    pub version: &'static str,
    /// The abbreviated git commit id, or [`UNKNOWN_REVISION`].
    pub revision: &'static str,
}

impl BuildInfo {
    /// This library's own version, and no revision: what [`get`] says
    /// before [`set`].
    pub const LIBRARY: Self = Self {
        version: env!("CARGO_PKG_VERSION"),
        revision: UNKNOWN_REVISION,
    };

    /// `<version> (<revision>)`: what `--version` prints after the
    /// binary's name.
    pub fn version_line(&self) -> String {
        format!("{} ({})", self.version, self.revision)
    }
}

/// The [`BuildInfo`] of the crate that expands it: its package version and
/// the git revision it is built from. Call it in a binary's `main.rs` and
/// hand the value to [`set`] (the argument parsers do), so a commit
/// recompiles `main.rs` and no library.
#[macro_export]
macro_rules! build_info {
    () => {
        $crate::build::BuildInfo {
            version: ::core::env!("CARGO_PKG_VERSION"),
            revision: $crate::build::revision!(),
        }
    };
}

struct Installed {
    info: BuildInfo,
    line: String,
}

static INSTALLED: OnceLock<Installed> = OnceLock::new();

fn installed(info: BuildInfo) -> &'static Installed {
    INSTALLED.get_or_init(|| Installed {
        info,
        line: info.version_line(),
    })
}

/// Makes `info` this process's build, once: the first call wins (a binary
/// calls it before anything reads [`get`]). Returns the build in force.
pub fn set(info: BuildInfo) -> BuildInfo {
    installed(info).info
}

/// This process's build: what [`set`] was given, else
/// [`BuildInfo::LIBRARY`].
pub fn get() -> BuildInfo {
    installed(BuildInfo::LIBRARY).info
}

/// [`get`]'s [`BuildInfo::version_line`], kept for the life of the
/// process (clap's `--version` wants a `&'static str`).
pub fn version_line() -> &'static str {
    &installed(BuildInfo::LIBRARY).line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_macro_gives_the_package_version_and_the_commit() {
        let info = crate::build_info!();
        assert_eq!(info.version, env!("CARGO_PKG_VERSION"));
        assert_eq!(info.version, BuildInfo::LIBRARY.version);
        let in_git = std::process::Command::new("git")
            .args(["-C", env!("CARGO_MANIFEST_DIR"), "rev-parse", "HEAD"])
            .output()
            .is_ok_and(|o| o.status.success());
        if option_env!("TOOLFLEET_GIT_REVISION").is_some_and(|r| !r.is_empty()) {
            assert_eq!(Some(info.revision), option_env!("TOOLFLEET_GIT_REVISION"));
        } else if in_git {
            assert!(
                info.revision.len() >= 12 && info.revision.chars().all(|c| c.is_ascii_hexdigit()),
                "{info:?}"
            );
        } else {
            assert_eq!(info.revision, UNKNOWN_REVISION);
        }
        // Usable where a constant is wanted.
        const REVISION: &str = revision!();
        assert_eq!(REVISION, info.revision);
    }

    #[test]
    fn the_version_line_names_both() {
        let info = BuildInfo {
            version: "1.2.3",
            revision: "0123456789ab",
        };
        assert_eq!(info.version_line(), "1.2.3 (0123456789ab)");
    }

    #[test]
    fn the_first_build_set_is_the_one_in_force() {
        // Tests share the process (under `cargo test`): another may have
        // read the build first, which fixes it as well.
        let in_force = set(BuildInfo {
            version: "9.9.9",
            revision: "first",
        });
        assert!(
            in_force.revision == "first" || in_force == BuildInfo::LIBRARY,
            "{in_force:?}"
        );
        let later = BuildInfo {
            version: "0.0.1",
            revision: "second",
        };
        assert_eq!(set(later), in_force);
        assert_eq!(get(), in_force);
        assert_eq!(version_line(), in_force.version_line());
    }
}

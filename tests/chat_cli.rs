//! `toolfleet chat` as a user runs it: the question from stdin with a
//! profile and a user, the answer printed once; `--json` errors on stderr
//! with a non-zero exit; Ctrl-C (SIGINT) publishes the cancel and waits for
//! the fleet's `error: cancelled`; no panic when the reader of the output
//! goes away.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;

use crate::support::{self, Env, WAIT};

fn chat(env: &Env) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_toolfleet"));
    c.arg("chat")
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_question_comes_from_stdin_and_the_answer_is_printed_once() {
    let env = Env::start(json!({
        "rules": [{ "whenUserContains": ["time"], "steps": [
            { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
            { "answer": "The clock says {{tool:current_datetime}}." }
        ] }]
    }))
    .await;
    let mut events = env.subscribe("toolfleet.chat.events.>".into()).await;
    let mut child = chat(&env)
        .args(["--profile", "default", "--user", "user-7"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What time is it?\n")
        .unwrap();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.matches("The clock says").count(), 1, "{stdout}");
    assert!(
        !stderr.contains("The clock says"),
        "the answer went to stderr too: {stderr}"
    );
    assert!(stderr.contains("→ system:current_datetime"), "{stderr}");
    // The job carried the user and the profile.
    let first = tokio::time::timeout(WAIT, events.next())
        .await
        .unwrap()
        .unwrap();
    let started: serde_json::Value = serde_json::from_slice(&first.payload).unwrap();
    assert_eq!(started["type"], "started", "{started}");
    assert_eq!(started["profile"], "default", "{started}");
    drop(env);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_errors_go_to_stderr_and_ctrl_c_cancels_the_invocation() {
    // Every model call takes 30 s: the client gives up first.
    let env = Env::start(json!({
        "firstTokenDelayMs": 30000,
        "rules": [],
        "default": { "steps": [ { "answer": "too late" } ] }
    }))
    .await;
    let out = chat(&env)
        .args(["--json", "--timeout", "1", "hello?"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert!(stderr.starts_with("error: "), "{stderr}");
    for line in stdout.lines() {
        serde_json::from_str::<serde_json::Value>(line).expect("stdout holds only events");
    }

    // Ctrl-C while the model thinks.
    let mut events = env.subscribe("toolfleet.chat.events.>".into()).await;
    let child = chat(&env).arg("hello again?").spawn().unwrap();
    let pid = child.id();
    let first = tokio::time::timeout(WAIT, events.next())
        .await
        .unwrap()
        .unwrap();
    let started: serde_json::Value = serde_json::from_slice(&first.payload).unwrap();
    let invocation = started["invocationId"].as_str().unwrap().to_owned();
    let status = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains(&format!("cancelling {invocation}")),
        "{stderr}"
    );
    assert!(stderr.trim_end().ends_with("cancelled"), "{stderr}");
    // The fleet ended the invocation as cancelled.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let msg = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("the invocation ends")
            .unwrap();
        let ev: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
        if ev["invocationId"] == invocation.as_str() && ev["type"] == "error" {
            assert_eq!(ev["code"], "cancelled", "{ev}");
            break;
        }
    }
}

#[test]
fn a_closed_pipe_ends_the_listing_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(["tools", "list"])
        .current_dir(support::root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The reader goes away before the first line is written.
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let _ = Duration::ZERO;
}

/// `toolfleet cancel INV`: a running invocation is cancelled and the
/// command says so once the fleet confirms; a finished one and an unknown
/// one are answered clearly, without pretending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cancel_command_confirms_or_says_why_not() {
    let env = Env::start(json!({
        "firstTokenDelayMs": 30000,
        "rules": [],
        "default": { "steps": [ { "answer": "too late" } ] }
    }))
    .await;
    let job = toolfleet_protocol::client::question("a long one");
    let mut events = env.follow_and_submit(&job).await;
    let started = support::next_json(&mut events).await;
    assert_eq!(started["type"], "started", "{started}");
    let cancel = |id: String| {
        let url = env.nats.url();
        tokio::task::spawn_blocking(move || {
            let out = Command::new(env!("CARGO_BIN_EXE_toolfleet"))
                .args(["cancel", &id])
                .env("TOOLFLEET_NATS_URL", url)
                .output()
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned()
                    + &String::from_utf8_lossy(&out.stderr),
            )
        })
    };
    let (code, said) = cancel(job.invocation_id.clone()).await.unwrap();
    assert_eq!(code, Some(0), "{said}");
    assert!(said.contains("cancelled"), "{said}");
    let (code, said) = cancel(job.invocation_id.clone()).await.unwrap();
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("already finished: error (cancelled)"),
        "{said}"
    );
    let (code, said) = cancel("inv-never-submitted".into()).await.unwrap();
    assert_eq!(code, Some(1), "{said}");
    assert!(said.contains("has no event"), "{said}");
    let (code, said) = cancel("not an id!".into()).await.unwrap();
    assert_eq!(code, Some(64), "{said}");
}

#[test]
fn completions_are_generated_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let out = Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .args(["completions", shell])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{shell}");
        assert!(
            text.contains("toolfleet") && text.contains("cancel") && text.contains("ingest"),
            "{shell}: {text}"
        );
    }
    let out = Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(["completions", "tcsh-ish"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64));
}

/// `toolfleet chat` run on a pseudo-terminal (`script` from util-linux
/// gives it one, as a user's terminal would): stdout and stderr both go to
/// the terminal, so what the user sees is one stream.
fn on_a_terminal(env: &Env, question: &str) -> Command {
    let command = format!("{} chat '{question}'", env!("CARGO_BIN_EXE_toolfleet"));
    let mut c = Command::new("script");
    // -q quiet, -e the child's exit code, -f flush, -c the command; the
    // typescript goes nowhere.
    c.args(["-qefc", &command, "/dev/null"])
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .env_remove("TOOLFLEET_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_terminal_a_progress_line_waits_and_the_answer_shows_once() {
    // The model takes a moment, so the progress line has time to show.
    let env = Env::start(json!({
        "firstTokenDelayMs": 1500,
        "rules": [{ "whenUserContains": ["time"], "steps": [
            { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
            { "answer": "The clock says {{tool:current_datetime}}." }
        ] }]
    }))
    .await;
    let child = on_a_terminal(&env, "What time is it?").spawn().unwrap();
    let out = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    let screen = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{screen}");
    // The progress line showed, with the tool call counted, and was
    // cleared before the answer.
    assert!(screen.contains("… waiting for the answer ("), "{screen:?}");
    assert!(screen.contains("1 tool call)"), "{screen:?}");
    let answer_at = screen.find("The clock says").expect("the answer");
    let cleared_at = screen[..answer_at]
        .rfind("\r\x1b[2K")
        .expect("the line is cleared");
    assert!(
        !screen[cleared_at..answer_at].contains("waiting"),
        "{screen:?}"
    );
    // On a terminal, too, the answer appears once (streamed text is not
    // printed again).
    assert_eq!(screen.matches("The clock says").count(), 1, "{screen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctrl_c_typed_on_the_terminal_cancels_the_invocation() {
    let env = Env::start(json!({
        "firstTokenDelayMs": 30000,
        "rules": [],
        "default": { "steps": [ { "answer": "too late" } ] }
    }))
    .await;
    let mut events = env.subscribe("toolfleet.chat.events.>".into()).await;
    let mut child = on_a_terminal(&env, "hello?").spawn().unwrap();
    let first = tokio::time::timeout(WAIT, events.next())
        .await
        .unwrap()
        .unwrap();
    let started: serde_json::Value = serde_json::from_slice(&first.payload).unwrap();
    let invocation = started["invocationId"].as_str().unwrap().to_owned();
    // The user types Ctrl-C: the terminal turns it into SIGINT for the
    // command in the foreground.
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"\x03").unwrap();
    stdin.flush().unwrap();
    let out = tokio::task::spawn_blocking(move || {
        let out = child.wait_with_output().unwrap();
        drop(stdin);
        out
    })
    .await
    .unwrap();
    let screen = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(130), "{screen:?}");
    assert!(
        screen.contains(&format!("cancelling {invocation}")),
        "{screen:?}"
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let msg = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("the invocation ends")
            .unwrap();
        let ev: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
        if ev["invocationId"] == invocation.as_str() && ev["type"] == "error" {
            assert_eq!(ev["code"], "cancelled", "{ev}");
            break;
        }
    }
}

//! MCP tasks (specification 2025-11-25) of `toolfleet mcp serve`: the
//! state of each task-augmented `tools/call`, as `tasks/get`,
//! `tasks/result`, `tasks/cancel` and `tasks/list` read it.
//!
//! A task is one fleet tool job: its id is the fresh invocation the job
//! runs in ([`CallIds`]), so a task id can be followed in the fleet's
//! logs and events. The state lives in this process (a map bounded by
//! [`MAX_TASKS`], each task kept for its `ttl` from creation): a task does
//! not outlive the `mcp serve` that started it — after a restart its id
//! is unknown, like any other id — and one `mcp serve` runs for one
//! tenant, so another tenant's tasks are never in its map.
//!
//! Nothing here speaks MCP's transports or the fleet: the server
//! (`super`) starts the calls and answers the requests; this module keeps
//! the books and writes the wire shapes. When `mcp serve` stops, the
//! fleet jobs of the tasks still working are cancelled
//! ([`TaskStore::cancel_all`]): no job runs on for a task nobody can
//! reach.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use serde_json::{Value, json};
use tokio::sync::watch;
use toolfleet_protocol::client::CallIds;

/// At most this many tasks are kept at once; a task-augmented call beyond
/// it is refused.
pub(crate) const MAX_TASKS: usize = 1000;
/// How long a task is kept when its request names no `ttl`.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(3600);
/// The longest `ttl` granted (a longer request is cut to it).
pub(crate) const MAX_TTL: Duration = Duration::from_secs(24 * 3600);
/// The polling interval suggested to clients.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Tasks per page of `tasks/list`.
pub(crate) const PAGE: usize = 50;
/// `_meta` key of the task a `tasks/result` answer belongs to.
pub(crate) const RELATED_TASK: &str = "io.modelcontextprotocol/related-task";

/// A task's status, as the specification names it (`input_required` is
/// never used: a fleet tool job has no way to ask an MCP client).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Working,
    Completed,
    Failed,
    Cancelled,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Working => "working",
            Status::Completed => "completed",
            Status::Failed => "failed",
            Status::Cancelled => "cancelled",
        }
    }

    fn is_terminal(self) -> bool {
        self != Status::Working
    }
}

/// What a finished task's `tasks/result` answers: the `tools/call` result,
/// or the JSON-RPC error the call would have been.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    Result(Value),
    Error(rmcp::ErrorData),
}

/// Why a task request cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum TaskError {
    /// No such task here: never made, expired, another tenant's, or made
    /// by an `mcp serve` that has since stopped.
    #[error("no task {0} (unknown, expired or not yours)")]
    NotFound(String),
    /// `tasks/cancel` of a task that already ended.
    #[error("task {0} already ended ({1}); it cannot be cancelled")]
    Terminal(String, &'static str),
    /// `tasks/list` with a cursor it never gave.
    #[error("the cursor {0:?} is not one tasks/list gave")]
    BadCursor(String),
    /// [`MAX_TASKS`] tasks are kept already.
    #[error("{MAX_TASKS} tasks are kept already; call without a task, or wait for some to expire")]
    TooMany,
}

impl TaskError {
    /// The JSON-RPC error the client reads: invalid params for a request
    /// about an unknown, ended task or a bad cursor, an internal error
    /// when full.
    pub(crate) fn to_rpc(&self) -> rmcp::ErrorData {
        match self {
            TaskError::TooMany => rmcp::ErrorData::internal_error(self.to_string(), None),
            _ => rmcp::ErrorData::invalid_params(self.to_string(), None),
        }
    }
}

/// One task.
struct Entry {
    seq: u64,
    ids: CallIds,
    created_at: SystemTime,
    updated_at: SystemTime,
    ttl: Duration,
    status: Status,
    message: Option<String>,
    outcome: Option<Outcome>,
    /// Turns true when the task ends.
    done: watch::Sender<bool>,
    /// The call's runner, aborted on cancel or expiry.
    runner: Option<tokio::task::AbortHandle>,
}

impl Entry {
    fn expired(&self, now: SystemTime) -> bool {
        now.duration_since(self.created_at)
            .is_ok_and(|age| age > self.ttl)
    }

    /// The task as the specification's `Task` object.
    fn to_wire(&self) -> Value {
        let mut task = json!({
            "taskId": self.ids.invocation_id,
            "status": self.status.as_str(),
            "createdAt": rfc3339(self.created_at),
            "lastUpdatedAt": rfc3339(self.updated_at),
            "ttl": self.ttl.as_millis() as u64,
            "pollInterval": POLL_INTERVAL.as_millis() as u64,
        });
        if let Some(message) = &self.message {
            task["statusMessage"] = json!(message);
        }
        task
    }
}

fn rfc3339(at: SystemTime) -> String {
    time::OffsetDateTime::from(at)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<String, Entry>,
    /// Task ids in the order they were made (`tasks/list`'s order).
    order: BTreeMap<u64, String>,
    next: u64,
}

impl Inner {
    /// Forgets the tasks whose ttl ran out, stopping those still working
    /// (their fleet jobs are cancelled as their runners drop).
    fn purge(&mut self, now: SystemTime) {
        let expired: Vec<String> = self
            .by_id
            .iter()
            .filter(|(_, e)| e.expired(now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            if let Some(entry) = self.by_id.remove(&id) {
                self.order.remove(&entry.seq);
                if let Some(runner) = entry.runner {
                    runner.abort();
                }
            }
        }
    }
}

/// The tasks of one `mcp serve`.
#[derive(Default)]
pub(crate) struct TaskStore {
    inner: Mutex<Inner>,
}

impl TaskStore {
    /// The books, purged of expired tasks. Nothing panics while holding
    /// them, so a poisoned lock still holds a consistent state.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        inner.purge(SystemTime::now());
        inner
    }

    /// A new working task for the call under `ids`, kept for the `ttl`
    /// (milliseconds) the client asked for, within [`MAX_TTL`]: its
    /// `CreateTaskResult`.
    ///
    /// # Errors
    ///
    /// [`TaskError::TooMany`] when [`MAX_TASKS`] are kept already.
    pub(crate) fn create(&self, ids: CallIds, ttl_ms: Option<u64>) -> Result<Value, TaskError> {
        let ttl = ttl_ms.map_or(DEFAULT_TTL, |ms| Duration::from_millis(ms).min(MAX_TTL));
        let mut inner = self.lock();
        if inner.by_id.len() >= MAX_TASKS {
            return Err(TaskError::TooMany);
        }
        let now = SystemTime::now();
        inner.next += 1;
        let seq = inner.next;
        let entry = Entry {
            seq,
            ids: ids.clone(),
            created_at: now,
            updated_at: now,
            ttl,
            status: Status::Working,
            message: Some("the fleet's tool job is running".into()),
            outcome: None,
            done: watch::channel(false).0,
            runner: None,
        };
        let wire = entry.to_wire();
        inner.order.insert(seq, ids.invocation_id.clone());
        inner.by_id.insert(ids.invocation_id, entry);
        Ok(json!({ "task": wire }))
    }

    /// Notes the runner of task `id`, to stop it on cancel; stops it at
    /// once when the task is gone already.
    pub(crate) fn attach(&self, id: &str, runner: tokio::task::AbortHandle) {
        match self.lock().by_id.get_mut(id) {
            Some(entry) if !entry.status.is_terminal() => entry.runner = Some(runner),
            _ => runner.abort(),
        }
    }

    /// The tool's progress `message`, as the task's status message.
    pub(crate) fn progress(&self, id: &str, message: &str) {
        if let Some(entry) = self.lock().by_id.get_mut(id)
            && !entry.status.is_terminal()
        {
            entry.message = Some(message.to_string());
            entry.updated_at = SystemTime::now();
        }
    }

    /// Ends task `id` with `status` and its `outcome`, unless it ended
    /// already (a cancelled task stays cancelled).
    pub(crate) fn finish(&self, id: &str, status: Status, message: String, outcome: Outcome) {
        if let Some(entry) = self.lock().by_id.get_mut(id)
            && !entry.status.is_terminal()
        {
            entry.status = status;
            entry.message = Some(message);
            entry.outcome = Some(outcome);
            entry.updated_at = SystemTime::now();
            entry.runner = None;
            entry.done.send_replace(true);
        }
    }

    /// `tasks/get`: the task.
    ///
    /// # Errors
    ///
    /// [`TaskError::NotFound`].
    pub(crate) fn get(&self, id: &str) -> Result<Value, TaskError> {
        self.lock()
            .by_id
            .get(id)
            .map(Entry::to_wire)
            .ok_or_else(|| TaskError::NotFound(id.to_string()))
    }

    /// `tasks/cancel`: the task marked cancelled (its runner stopped), and
    /// the ids of the fleet call to cancel.
    ///
    /// # Errors
    ///
    /// [`TaskError::NotFound`]; [`TaskError::Terminal`] when it ended.
    pub(crate) fn cancel(&self, id: &str) -> Result<(Value, CallIds), TaskError> {
        let mut inner = self.lock();
        let entry = inner
            .by_id
            .get_mut(id)
            .ok_or_else(|| TaskError::NotFound(id.to_string()))?;
        if entry.status.is_terminal() {
            return Err(TaskError::Terminal(id.to_string(), entry.status.as_str()));
        }
        entry.status = Status::Cancelled;
        entry.message = Some("cancelled by the client; the fleet's tool job was cancelled".into());
        entry.updated_at = SystemTime::now();
        entry.outcome = Some(Outcome::Error(rmcp::ErrorData::invalid_params(
            format!("task {id} was cancelled"),
            None,
        )));
        if let Some(runner) = entry.runner.take() {
            runner.abort();
        }
        entry.done.send_replace(true);
        Ok((entry.to_wire(), entry.ids.clone()))
    }

    /// The calls of the tasks still working, all marked cancelled (the
    /// server is stopping: its tasks end with it).
    pub(crate) fn cancel_all(&self) -> Vec<CallIds> {
        let inner = self.lock();
        let working: Vec<String> = inner
            .by_id
            .iter()
            .filter(|(_, e)| !e.status.is_terminal())
            .map(|(id, _)| id.clone())
            .collect();
        drop(inner);
        working
            .iter()
            .filter_map(|id| self.cancel(id).ok().map(|(_, ids)| ids))
            .collect()
    }

    /// `tasks/result`: waits until task `id` ends, then its outcome (a
    /// result carries the task in its `_meta`).
    ///
    /// # Errors
    ///
    /// [`TaskError::NotFound`], also when it expires while waited on.
    pub(crate) async fn result(&self, id: &str) -> Result<Outcome, TaskError> {
        let mut done = self
            .lock()
            .by_id
            .get(id)
            .map(|e| e.done.subscribe())
            .ok_or_else(|| TaskError::NotFound(id.to_string()))?;
        // A sender dropped (the task purged) ends the wait too.
        let _ = done.wait_for(|d| *d).await;
        let inner = self.lock();
        let outcome = inner
            .by_id
            .get(id)
            .and_then(|e| e.outcome.clone())
            .ok_or_else(|| TaskError::NotFound(id.to_string()))?;
        Ok(match outcome {
            Outcome::Result(mut result) => {
                if let Some(object) = result.as_object_mut() {
                    let meta = object.entry("_meta").or_insert_with(|| json!({}));
                    meta[RELATED_TASK] = json!({ "taskId": id });
                }
                Outcome::Result(result)
            }
            error => error,
        })
    }

    /// `tasks/list`: a page of tasks from `cursor`, oldest first, and the
    /// cursor of the next page when there is one.
    ///
    /// # Errors
    ///
    /// [`TaskError::BadCursor`].
    pub(crate) fn list(&self, cursor: Option<&str>) -> Result<Value, TaskError> {
        let inner = self.lock();
        let after = match cursor {
            None => 0,
            Some(c) => c
                .parse::<u64>()
                .map_err(|_| TaskError::BadCursor(c.to_string()))?,
        };
        let mut page = inner.order.range(after + 1..).take(PAGE + 1);
        let mut tasks = Vec::new();
        let mut last = None;
        for (seq, id) in page.by_ref().take(PAGE) {
            if let Some(entry) = inner.by_id.get(id) {
                tasks.push(entry.to_wire());
                last = Some(*seq);
            }
        }
        let mut out = json!({ "tasks": tasks });
        if page.next().is_some()
            && let Some(last) = last
        {
            out["nextCursor"] = json!(last.to_string());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: u32) -> CallIds {
        CallIds {
            invocation_id: format!("inv-{n}"),
            call_id: format!("call_{n}"),
        }
    }

    #[test]
    fn a_task_is_working_until_it_ends_and_then_stays_ended() {
        let store = TaskStore::default();
        let created = store.create(ids(1), Some(60_000)).unwrap();
        assert_eq!(created["task"]["taskId"], "inv-1");
        assert_eq!(created["task"]["status"], "working");
        assert_eq!(created["task"]["ttl"], 60_000);
        store.progress("inv-1", "halfway");
        assert_eq!(store.get("inv-1").unwrap()["statusMessage"], "halfway");
        let (cancelled, call) = store.cancel("inv-1").unwrap();
        assert_eq!(cancelled["status"], "cancelled");
        assert_eq!(call, ids(1));
        // The result that comes after the cancel does not undo it.
        store.finish(
            "inv-1",
            Status::Completed,
            "done".into(),
            Outcome::Result(json!({})),
        );
        assert_eq!(store.get("inv-1").unwrap()["status"], "cancelled");
        assert_eq!(
            store.cancel("inv-1"),
            Err(TaskError::Terminal("inv-1".into(), "cancelled"))
        );
        assert_eq!(store.get("inv-2"), Err(TaskError::NotFound("inv-2".into())));
    }

    #[test]
    fn a_ttl_is_cut_to_the_longest_granted_and_an_expired_task_is_forgotten() {
        let store = TaskStore::default();
        let created = store.create(ids(1), Some(u64::MAX)).unwrap();
        assert_eq!(created["task"]["ttl"], MAX_TTL.as_millis() as u64);
        store.create(ids(2), Some(0)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(store.get("inv-2"), Err(TaskError::NotFound("inv-2".into())));
        assert!(store.get("inv-1").is_ok());
    }

    #[test]
    fn tasks_are_listed_in_pages_with_a_cursor() {
        let store = TaskStore::default();
        for n in 0..(PAGE as u32 + 3) {
            store.create(ids(n), None).unwrap();
        }
        let first = store.list(None).unwrap();
        assert_eq!(first["tasks"].as_array().unwrap().len(), PAGE);
        assert_eq!(first["tasks"][0]["taskId"], "inv-0");
        let cursor = first["nextCursor"].as_str().unwrap();
        let second = store.list(Some(cursor)).unwrap();
        assert_eq!(second["tasks"].as_array().unwrap().len(), 3);
        assert!(second.get("nextCursor").is_none(), "{second}");
        assert_eq!(
            store.list(Some("nonsense")),
            Err(TaskError::BadCursor("nonsense".into()))
        );
    }

    #[test]
    fn no_more_than_max_tasks_are_kept() {
        let store = TaskStore::default();
        for n in 0..MAX_TASKS as u32 {
            store.create(ids(n), None).unwrap();
        }
        assert_eq!(store.create(ids(99_999), None), Err(TaskError::TooMany));
    }

    #[tokio::test]
    async fn a_result_waits_for_the_end_and_names_its_task() {
        let store = std::sync::Arc::new(TaskStore::default());
        store.create(ids(1), None).unwrap();
        let waiting = tokio::spawn({
            let store = store.clone();
            async move { store.result("inv-1").await }
        });
        tokio::task::yield_now().await;
        store.finish(
            "inv-1",
            Status::Completed,
            "done".into(),
            Outcome::Result(json!({ "content": [], "isError": false })),
        );
        let Outcome::Result(result) = waiting.await.unwrap().unwrap() else {
            panic!("a result");
        };
        assert_eq!(result["_meta"][RELATED_TASK]["taskId"], "inv-1");
    }
}

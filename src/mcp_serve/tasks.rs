//! MCP tasks (specification 2025-11-25) of `toolfleet mcp serve`: the
//! state of each task-augmented `tools/call`, as `tasks/get`,
//! `tasks/result`, `tasks/cancel` and `tasks/list` read it.
//!
//! A task is one fleet tool job: its id is the fresh invocation the job
//! runs in ([`CallIds`]), so a task id can be followed in the fleet's
//! logs and events. The state lives in this process (a map bounded by
//! [`MAX_TASKS`], [`MAX_TASKS_PER_OWNER`] per requestor, each task kept for
//! its granted `ttl` from creation): a task does not outlive the `mcp
//! serve` that started it — after a restart its id is unknown, like any
//! other id — and one `mcp serve` runs for one tenant, so another tenant's
//! tasks are never in its map.
//!
//! **Every task is its requestor's** (its owner: the hash of the
//! `Authorization` header a proxy authenticated, else the HTTP session;
//! over stdio the one client): `tasks/get`, `tasks/result`, `tasks/cancel`
//! and `tasks/list` of another owner's task answer "not found", as for an
//! id never made.
//!
//! **Room.** When the map is full, finished tasks make room, the least
//! useful first: cancelled and failed ones, then completed ones whose
//! result was fetched, then the other completed ones, oldest first
//! within each; working tasks are never dropped for room. An owner with
//! [`MAX_TASKS_PER_OWNER`] tasks makes room among its own the same way.
//! The ttl granted is within [[`MIN_TTL`] or the tool's timeout and a
//! margin, [`MAX_TTL`]] whatever was asked, so a task is never forgotten
//! before its job can end. Expired tasks are forgotten at every request
//! and by [`TaskStore::sweep`] on a timer.
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

/// At most this many tasks are kept at once: finished ones make room; a
/// task-augmented call when all are working is refused.
pub(crate) const MAX_TASKS: usize = 1000;
/// At most this many tasks of one owner are kept at once.
pub(crate) const MAX_TASKS_PER_OWNER: usize = 100;
/// How long a task is kept when its request names no `ttl`.
pub(crate) const DEFAULT_TTL: Duration = Duration::from_secs(3600);
/// The shortest `ttl` granted (a shorter request is raised to it, or to
/// the tool's timeout and a margin when that is longer).
pub(crate) const MIN_TTL: Duration = Duration::from_secs(60);
/// The longest `ttl` granted (a longer request is cut to it), unless the
/// tool's timeout needs longer.
pub(crate) const MAX_TTL: Duration = Duration::from_secs(6 * 3600);
/// How often expired tasks are forgotten when no request comes.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(30);
/// The polling interval suggested to clients.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(500);
/// Tasks per page of `tasks/list`.
pub(crate) const PAGE: usize = 50;
/// The `tasks/list` cursors remembered (older ones are refused).
const MAX_CURSORS: usize = 1000;
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
    /// No such task here: never made, expired, another requestor's or
    /// tenant's, or made by an `mcp serve` that has since stopped.
    #[error("no task {0} (unknown, expired or not yours)")]
    NotFound(String),
    /// `tasks/cancel` of a task that already ended.
    #[error("task {0} already ended ({1}); it cannot be cancelled")]
    Terminal(String, &'static str),
    /// `tasks/list` with a cursor it never gave.
    #[error("the cursor {0:?} is not one tasks/list gave")]
    BadCursor(String),
    /// [`MAX_TASKS`] tasks are working already.
    #[error("{MAX_TASKS} tasks are working already; call without a task, or wait for some to end")]
    TooMany,
    /// The requestor has [`MAX_TASKS_PER_OWNER`] tasks working already.
    #[error(
        "you have {MAX_TASKS_PER_OWNER} tasks working already; call without a task, or wait for some to end"
    )]
    TooManyOfYours,
}

impl TaskError {
    /// The JSON-RPC error the client reads: invalid params for a request
    /// about an unknown, ended task or a bad cursor, an internal error
    /// when full.
    pub(crate) fn to_rpc(&self) -> rmcp::ErrorData {
        match self {
            TaskError::TooMany | TaskError::TooManyOfYours => {
                rmcp::ErrorData::internal_error(self.to_string(), None)
            }
            _ => rmcp::ErrorData::invalid_params(self.to_string(), None),
        }
    }
}

/// One task.
struct Entry {
    seq: u64,
    /// Its requestor: only it may read, cancel or list the task.
    owner: String,
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
    /// Its result was fetched (`tasks/result` answered).
    fetched: bool,
}

impl Entry {
    /// How readily it makes room: `None` for a working task (never), then
    /// lower first — cancelled or failed, completed and fetched,
    /// completed — and older first.
    fn room_rank(&self) -> Option<(u8, u64)> {
        let class = match self.status {
            Status::Working => return None,
            Status::Cancelled | Status::Failed => 0,
            Status::Completed if self.fetched => 1,
            Status::Completed => 2,
        };
        Some((class, self.seq))
    }

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
    /// The cursors `tasks/list` gave: cursor → (owner, last seq listed),
    /// and their order (the oldest forgotten first).
    cursors: HashMap<String, (String, u64)>,
    cursor_order: std::collections::VecDeque<String>,
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
            self.forget(&id);
        }
    }

    fn forget(&mut self, id: &str) {
        if let Some(entry) = self.by_id.remove(id) {
            self.order.remove(&entry.seq);
            if let Some(runner) = entry.runner {
                runner.abort();
            }
        }
    }

    /// Makes room for one more task of `owner`: drops the finished task
    /// that makes room most readily (of the owner's, when it has its
    /// fill; of all, when the map is full).
    ///
    /// # Errors
    ///
    /// [`TaskError::TooManyOfYours`] or [`TaskError::TooMany`] when every
    /// task in the way is working.
    fn make_room(&mut self, owner: &str) -> Result<(), TaskError> {
        let owned = self.by_id.values().filter(|e| e.owner == owner).count();
        if owned >= MAX_TASKS_PER_OWNER {
            let victim = self.victim(|e| e.owner == owner);
            self.forget(&victim.ok_or(TaskError::TooManyOfYours)?);
        }
        if self.by_id.len() >= MAX_TASKS {
            let victim = self.victim(|_| true);
            self.forget(&victim.ok_or(TaskError::TooMany)?);
        }
        Ok(())
    }

    /// The finished task among `which` that makes room most readily.
    fn victim(&self, which: impl Fn(&Entry) -> bool) -> Option<String> {
        self.by_id
            .iter()
            .filter(|(_, e)| which(e))
            .filter_map(|(id, e)| e.room_rank().map(|rank| (rank, id)))
            .min()
            .map(|(_, id)| id.clone())
    }

    /// A new random cursor for `owner`, after `seq`.
    fn give_cursor(&mut self, owner: &str, seq: u64) -> String {
        let mut bytes = [0u8; 16];
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes);
        let cursor: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        if self.cursor_order.len() >= MAX_CURSORS
            && let Some(old) = self.cursor_order.pop_front()
        {
            self.cursors.remove(&old);
        }
        self.cursor_order.push_back(cursor.clone());
        self.cursors
            .insert(cursor.clone(), (owner.to_string(), seq));
        cursor
    }

    /// `owner`'s task `id`.
    fn owned(&self, owner: &str, id: &str) -> Result<&Entry, TaskError> {
        self.by_id
            .get(id)
            .filter(|e| e.owner == owner)
            .ok_or_else(|| TaskError::NotFound(id.to_string()))
    }

    fn owned_mut(&mut self, owner: &str, id: &str) -> Result<&mut Entry, TaskError> {
        self.by_id
            .get_mut(id)
            .filter(|e| e.owner == owner)
            .ok_or_else(|| TaskError::NotFound(id.to_string()))
    }
}

/// The ttl granted for a request of `asked` (milliseconds) for a tool of
/// `timeout`: the ask (or [`DEFAULT_TTL`]) within [`MAX_TTL`], raised to
/// [`MIN_TTL`] or the tool's timeout and a margin — a task is never
/// forgotten before its job can end.
pub(crate) fn granted_ttl(asked: Option<u64>, timeout: Duration) -> Duration {
    let floor = MIN_TTL.max(timeout + MIN_TTL);
    asked
        .map_or(DEFAULT_TTL, Duration::from_millis)
        .min(MAX_TTL)
        .max(floor)
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

    /// Forgets the expired tasks every [`SWEEP_EVERY`] until the store is
    /// dropped: a working task whose ttl ran out is stopped even when no
    /// request comes.
    pub(crate) fn sweep(store: &std::sync::Arc<Self>) {
        let weak = std::sync::Arc::downgrade(store);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(SWEEP_EVERY);
            loop {
                every.tick().await;
                match weak.upgrade() {
                    Some(store) => drop(store.lock()),
                    None => return,
                }
            }
        });
    }

    /// A new working task of `owner` for the call under `ids`, kept for
    /// `ttl` (see [`granted_ttl`]): its `CreateTaskResult`. Finished tasks
    /// make room when the owner or the map is full.
    ///
    /// # Errors
    ///
    /// [`TaskError::TooManyOfYours`], [`TaskError::TooMany`]: every task
    /// in the way is working.
    pub(crate) fn create(
        &self,
        owner: &str,
        ids: CallIds,
        ttl: Duration,
    ) -> Result<Value, TaskError> {
        let mut inner = self.lock();
        inner.make_room(owner)?;
        let now = SystemTime::now();
        inner.next += 1;
        let seq = inner.next;
        let entry = Entry {
            seq,
            owner: owner.to_string(),
            ids: ids.clone(),
            created_at: now,
            updated_at: now,
            ttl,
            status: Status::Working,
            message: Some("the fleet's tool job is running".into()),
            outcome: None,
            done: watch::channel(false).0,
            runner: None,
            fetched: false,
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

    /// `tasks/get`: `owner`'s task.
    ///
    /// # Errors
    ///
    /// [`TaskError::NotFound`], also for another owner's.
    pub(crate) fn get(&self, owner: &str, id: &str) -> Result<Value, TaskError> {
        self.lock().owned(owner, id).map(Entry::to_wire)
    }

    /// `tasks/cancel`: the task marked cancelled (its runner stopped), and
    /// the ids of the fleet call to cancel.
    ///
    /// # Errors
    ///
    /// [`TaskError::NotFound`]; [`TaskError::Terminal`] when it ended.
    pub(crate) fn cancel(&self, owner: &str, id: &str) -> Result<(Value, CallIds), TaskError> {
        let mut inner = self.lock();
        let entry = inner.owned_mut(owner, id)?;
        if entry.status.is_terminal() {
            return Err(TaskError::Terminal(id.to_string(), entry.status.as_str()));
        }
        entry.status = Status::Cancelled;
        entry.message = Some("cancelled by the client; the fleet's tool job was cancelled".into());
        entry.updated_at = SystemTime::now();
        // What the `tools/call` itself answers when cancelled (the spec:
        // `tasks/result` answers what the request would have): an
        // internal error, not the invalid params of an unknown id.
        entry.outcome = Some(Outcome::Error(rmcp::ErrorData::internal_error(
            format!("task {id} was cancelled; it has no result"),
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
        let working: Vec<(String, String)> = inner
            .by_id
            .iter()
            .filter(|(_, e)| !e.status.is_terminal())
            .map(|(id, e)| (e.owner.clone(), id.clone()))
            .collect();
        drop(inner);
        working
            .iter()
            .filter_map(|(owner, id)| self.cancel(owner, id).ok().map(|(_, ids)| ids))
            .collect()
    }

    /// `tasks/result`: waits until task `id` ends, then its outcome (a
    /// result carries the task in its `_meta`).
    ///
    /// # Errors
    ///
    /// [`TaskError::NotFound`] (also for another owner's), also when it
    /// expires while waited on.
    pub(crate) async fn result(&self, owner: &str, id: &str) -> Result<Outcome, TaskError> {
        let mut done = self.lock().owned(owner, id).map(|e| e.done.subscribe())?;
        // A sender dropped (the task purged) ends the wait too.
        let _ = done.wait_for(|d| *d).await;
        let mut inner = self.lock();
        let entry = inner.owned_mut(owner, id)?;
        entry.fetched = true;
        let outcome = entry
            .outcome
            .clone()
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

    /// `tasks/list`: a page of `owner`'s tasks from `cursor`, oldest
    /// first, and the cursor of the next page when there is one. A cursor
    /// is a random one this store gave `owner` (the last [`MAX_CURSORS`]).
    ///
    /// # Errors
    ///
    /// [`TaskError::BadCursor`].
    pub(crate) fn list(&self, owner: &str, cursor: Option<&str>) -> Result<Value, TaskError> {
        let mut inner = self.lock();
        let after = match cursor {
            None => 0,
            Some(c) => match inner.cursors.get(c) {
                Some((given_to, seq)) if given_to == owner => *seq,
                _ => return Err(TaskError::BadCursor(c.to_string())),
            },
        };
        let mut page = inner
            .order
            .range(after + 1..)
            .filter_map(|(seq, id)| inner.by_id.get(id).map(|e| (seq, e)))
            .filter(|(_, e)| e.owner == owner);
        let mut tasks = Vec::new();
        let mut last = None;
        for (seq, entry) in page.by_ref().take(PAGE) {
            tasks.push(entry.to_wire());
            last = Some(*seq);
        }
        let more = page.next().is_some();
        let mut out = json!({ "tasks": tasks });
        if more && let Some(last) = last {
            out["nextCursor"] = json!(inner.give_cursor(owner, last));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: &str = "session:alice";
    const MALLORY: &str = "session:mallory";
    const HOUR: Duration = Duration::from_secs(3600);

    fn ids(n: u32) -> CallIds {
        CallIds {
            invocation_id: format!("inv-{n}"),
            call_id: format!("call_{n}"),
        }
    }

    fn done(store: &TaskStore, n: u32, status: Status) {
        store.finish(
            &format!("inv-{n}"),
            status,
            "done".into(),
            Outcome::Result(json!({})),
        );
    }

    #[test]
    fn a_task_is_working_until_it_ends_and_then_stays_ended() {
        let store = TaskStore::default();
        let created = store.create(ALICE, ids(1), HOUR).unwrap();
        assert_eq!(created["task"]["taskId"], "inv-1");
        assert_eq!(created["task"]["status"], "working");
        assert_eq!(created["task"]["ttl"], 3_600_000);
        store.progress("inv-1", "halfway");
        assert_eq!(
            store.get(ALICE, "inv-1").unwrap()["statusMessage"],
            "halfway"
        );
        let (cancelled, call) = store.cancel(ALICE, "inv-1").unwrap();
        assert_eq!(cancelled["status"], "cancelled");
        assert_eq!(call, ids(1));
        // The result that comes after the cancel does not undo it.
        done(&store, 1, Status::Completed);
        assert_eq!(store.get(ALICE, "inv-1").unwrap()["status"], "cancelled");
        assert_eq!(
            store.cancel(ALICE, "inv-1"),
            Err(TaskError::Terminal("inv-1".into(), "cancelled"))
        );
        assert_eq!(
            store.get(ALICE, "inv-2"),
            Err(TaskError::NotFound("inv-2".into()))
        );
    }

    #[tokio::test]
    async fn another_requestors_task_is_not_found() {
        let store = TaskStore::default();
        store.create(ALICE, ids(1), HOUR).unwrap();
        assert_eq!(
            store.get(MALLORY, "inv-1"),
            Err(TaskError::NotFound("inv-1".into()))
        );
        assert!(matches!(
            store.cancel(MALLORY, "inv-1"),
            Err(TaskError::NotFound(_))
        ));
        assert!(matches!(
            store.result(MALLORY, "inv-1").await,
            Err(TaskError::NotFound(_))
        ));
        assert_eq!(store.list(MALLORY, None).unwrap()["tasks"], json!([]));
        // Still working, and alice's.
        assert_eq!(store.get(ALICE, "inv-1").unwrap()["status"], "working");
        assert_eq!(
            store.list(ALICE, None).unwrap()["tasks"][0]["taskId"],
            "inv-1"
        );
    }

    #[test]
    fn the_ttl_granted_is_never_below_the_tools_timeout_and_a_margin() {
        let quick = Duration::from_secs(10);
        assert_eq!(granted_ttl(Some(0), quick), quick + MIN_TTL);
        assert_eq!(granted_ttl(Some(1), quick), quick + MIN_TTL);
        assert_eq!(granted_ttl(None, quick), DEFAULT_TTL);
        assert_eq!(granted_ttl(Some(600_000), quick), Duration::from_secs(600));
        assert_eq!(granted_ttl(Some(u64::MAX), quick), MAX_TTL);
        // A tool longer than the longest ttl still gets its time.
        let long = MAX_TTL + HOUR;
        assert_eq!(granted_ttl(Some(1000), long), long + MIN_TTL);
        // A task asked with ttl 0 is kept (and its job runs) for the floor.
        let store = TaskStore::default();
        let created = store
            .create(ALICE, ids(1), granted_ttl(Some(0), quick))
            .unwrap();
        assert_eq!(created["task"]["ttl"], 70_000);
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(store.get(ALICE, "inv-1").unwrap()["status"], "working");
    }

    #[test]
    fn an_expired_task_is_forgotten() {
        let store = TaskStore::default();
        store.create(ALICE, ids(1), HOUR).unwrap();
        store.create(ALICE, ids(2), Duration::ZERO).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(
            store.get(ALICE, "inv-2"),
            Err(TaskError::NotFound("inv-2".into()))
        );
        assert!(store.get(ALICE, "inv-1").is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn an_expired_working_task_is_stopped_on_a_timer_without_any_request() {
        let store = std::sync::Arc::new(TaskStore::default());
        store
            .create(ALICE, ids(1), Duration::from_millis(300))
            .unwrap();
        let runner = tokio::spawn(std::future::pending::<()>());
        store.attach("inv-1", runner.abort_handle());
        // Its ttl runs out (the books go by the wall clock).
        std::thread::sleep(Duration::from_millis(400));
        TaskStore::sweep(&store);
        // No request touches the store: the timer alone stops the job.
        let stopped = tokio::time::timeout(SWEEP_EVERY * 3, runner)
            .await
            .expect("the sweep stopped the job")
            .unwrap_err();
        assert!(stopped.is_cancelled(), "{stopped:?}");
    }

    #[test]
    fn tasks_are_listed_in_pages_with_a_cursor_given_to_their_owner() {
        let store = TaskStore::default();
        for n in 0..(PAGE as u32 + 3) {
            store.create(ALICE, ids(n), HOUR).unwrap();
        }
        store.create(MALLORY, ids(999), HOUR).unwrap();
        let first = store.list(ALICE, None).unwrap();
        assert_eq!(first["tasks"].as_array().unwrap().len(), PAGE);
        assert_eq!(first["tasks"][0]["taskId"], "inv-0");
        let cursor = first["nextCursor"].as_str().unwrap();
        let second = store.list(ALICE, Some(cursor)).unwrap();
        assert_eq!(second["tasks"].as_array().unwrap().len(), 3);
        assert!(second.get("nextCursor").is_none(), "{second}");
        for bad in ["nonsense", "0", "c1", ""] {
            assert_eq!(
                store.list(ALICE, Some(bad)),
                Err(TaskError::BadCursor(bad.into()))
            );
        }
        // Another owner cannot use alice's cursor.
        assert_eq!(
            store.list(MALLORY, Some(cursor)),
            Err(TaskError::BadCursor(cursor.into()))
        );
    }

    #[test]
    fn finished_tasks_make_room_the_least_useful_first() {
        let store = TaskStore::default();
        // A full map of many owners' tasks: 0..MAX_TASKS.
        for n in 0..MAX_TASKS as u32 {
            let owner = format!("session:{}", n % 20);
            store.create(&owner, ids(n), HOUR).unwrap();
        }
        let owner_of = |n: u32| format!("session:{}", n % 20);
        // 1 completed and fetched, 2 completed, 3 failed, 4 cancelled.
        for (n, status) in [
            (1, Status::Completed),
            (2, Status::Completed),
            (3, Status::Failed),
        ] {
            done(&store, n, status);
        }
        store.cancel(&owner_of(4), "inv-4").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(store.result(&owner_of(1), "inv-1")).unwrap();

        let gone =
            |store: &TaskStore, n: u32| store.get(&owner_of(n), &format!("inv-{n}")).is_err();
        // Failed and cancelled first (the older first), then completed
        // and fetched, then completed.
        let expected = [3, 4, 1, 2];
        for (k, victim) in expected.iter().enumerate() {
            let n = 10_000 + k as u32;
            store.create("session:new", ids(n), HOUR).unwrap();
            assert!(gone(&store, *victim), "inv-{victim} made room");
            for later in &expected[k + 1..] {
                assert!(!gone(&store, *later), "inv-{later} still kept");
            }
        }
        // Only working tasks left: refused.
        assert_eq!(
            store.create("session:new", ids(20_000), HOUR),
            Err(TaskError::TooMany)
        );
        assert!(!gone(&store, 0));
    }

    #[test]
    fn one_owner_has_at_most_its_share() {
        let store = TaskStore::default();
        for n in 0..MAX_TASKS_PER_OWNER as u32 {
            store.create(ALICE, ids(n), HOUR).unwrap();
        }
        assert_eq!(
            store.create(ALICE, ids(500), HOUR),
            Err(TaskError::TooManyOfYours)
        );
        // Others are not held up by alice.
        store.create(MALLORY, ids(501), HOUR).unwrap();
        // One of alice's ending makes room for her next.
        done(&store, 7, Status::Completed);
        store.create(ALICE, ids(502), HOUR).unwrap();
        assert!(store.get(ALICE, "inv-7").is_err());
        assert!(store.get(ALICE, "inv-8").is_ok());
    }

    #[tokio::test]
    async fn a_result_waits_for_the_end_and_names_its_task() {
        let store = std::sync::Arc::new(TaskStore::default());
        store.create(ALICE, ids(1), HOUR).unwrap();
        let waiting = tokio::spawn({
            let store = store.clone();
            async move { store.result(ALICE, "inv-1").await }
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

    #[tokio::test]
    async fn a_cancelled_tasks_result_is_not_an_unknown_ids_error() {
        let store = TaskStore::default();
        store.create(ALICE, ids(1), HOUR).unwrap();
        store.cancel(ALICE, "inv-1").unwrap();
        let Outcome::Error(e) = store.result(ALICE, "inv-1").await.unwrap() else {
            panic!("an error");
        };
        assert_eq!(e.code, rmcp::model::ErrorCode::INTERNAL_ERROR);
        assert!(e.message.contains("was cancelled"), "{e:?}");
        assert_eq!(
            TaskError::NotFound("x".into()).to_rpc().code,
            rmcp::model::ErrorCode::INVALID_PARAMS
        );
    }
}

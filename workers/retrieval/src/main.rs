//! `toolfleet-worker-retrieval`: serves retrieval:* tools over the document
//! index (tantivy on this host's disk, or a shared PostgreSQL). Start more
//! copies to scale the pool: they share one durable consumer per tool.
//! Configured by flags and `TOOLFLEET_*` environment variables.

use toolfleet_worker_retrieval::IndexArgs;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    toolfleet_worker::process::main(
        "toolfleet-worker-retrieval",
        toolfleet_worker::build_info!(),
        "toolfleet worker: serves retrieval:* tools over the document index.",
        "0.0.0.0:9466",
        async |args, index: &IndexArgs| {
            let store = toolfleet_worker_retrieval::open_and_seed(index).await?;
            let embedder = index.embedder()?;
            toolfleet_worker_retrieval::worker(&args.defs.dir, store, embedder)
                .map_err(|e| e.to_string())
        },
    )
    .await
}

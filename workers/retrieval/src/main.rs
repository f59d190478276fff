//! `toolfleet-worker-retrieval`: serves retrieval:* tools over the document
//! index. Start more copies to scale the pool: they share one durable
//! consumer per tool. Configured by flags and `TOOLFLEET_*` environment
//! variables.

use toolfleet_worker_retrieval::IndexArgs;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    toolfleet_worker::process::main(
        "toolfleet-worker-retrieval",
        "toolfleet worker: serves retrieval:* tools over the document index.",
        "0.0.0.0:9466",
        |args, index: &IndexArgs| {
            let docs = toolfleet_worker_retrieval::open_or_build_index(
                &index.index_dir,
                &index.corpus_dir,
            )
            .map_err(|e| e.to_string())?;
            toolfleet_worker_retrieval::worker(&args.defs.dir, &docs).map_err(|e| e.to_string())
        },
    )
    .await
}

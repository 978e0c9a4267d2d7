//! Tables published by R code (`rvisor_publish(df)`): the built-in host
//! tool that stores them, and the list a call's result carries.

use super::lock;
use crate::tables::{TableFormat, TableStore};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};

/// Tables published during calls: (execution id, table metadata).
pub(super) type Published = Arc<Mutex<Vec<(String, Value)>>>;

/// Takes the tables published by call `execution_id`.
pub(super) fn take_published(p: &Published, execution_id: &str) -> Vec<Value> {
    let mut all = lock(p);
    let (mine, rest): (Vec<_>, Vec<_>) = all.drain(..).partition(|(id, _)| id == execution_id);
    *all = rest;
    mine.into_iter().map(|(_, v)| v).collect()
}

/// The built-in tool behind `rvisor_publish(df)`: stores the CSV the R
/// code wrote (in its own temporary directory) as a table of `tenant`, and
/// records it for the result's `published` list.
pub(super) fn publish_tool(
    store: Arc<TableStore>,
    tenant: String,
    record: Published,
) -> rvisor::Tool {
    let tool = rvisor::Tool::new(
        "rvisor.publish",
        "Publish a data frame as a data pointer",
        json!({"type": "object", "properties": {"path": {"type": "string"}, "name": {"type": "string"}}}),
        move |call| {
            let path = call.args["path"].as_str().ok_or("path is missing")?;
            let name = call.args["name"].as_str().unwrap_or("");
            // Copied to a spool file in pieces, then converted in bounded
            // memory: a big data frame is never whole in the supervisor.
            let mut src = rvisor::tools::open_worker_file(call, path).map_err(|e| e.to_string())?;
            let spool = store.spool_path();
            let copied = std::fs::File::create(&spool)
                .and_then(|mut dst| std::io::copy(&mut src, &mut dst))
                .map_err(|e| format!("failed to copy the published table: {e}"));
            let meta = copied.and_then(|_| {
                store
                    .put_file(&tenant, TableFormat::Csv, &spool)
                    .map_err(|e| e.to_string())
            });
            let _ = std::fs::remove_file(&spool);
            let meta = meta?;
            let mut v = serde_json::to_value(&meta).map_err(|e| e.to_string())?;
            if !name.is_empty() {
                v["name"] = json!(name);
            }
            lock(&record).push((call.execution_id.clone(), v.clone()));
            Ok(v)
        },
    );
    // The name is a constant that matches the rules.
    tool.unwrap_or_else(|e| unreachable!("{e}"))
}

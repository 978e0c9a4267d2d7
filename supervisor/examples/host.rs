//! A small host program that links the rvisor library: it registers a tool,
//! runs calls in two sessions concurrently and prints the results.
//!
//! Run with `cargo run -p rvisor --example host` (after `cargo build`).

use rvisor::{SessionOptions, Supervisor, SupervisorConfig, Tool};
use serde_json::json;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let sup = Supervisor::new(SupervisorConfig::default())?;

    // A tool the R code can call as tools$lookup_price(item = "apple").
    let prices = Tool::new(
        "lookup_price",
        "Price of an item in the host's catalogue",
        json!({"type": "object", "properties": {"item": {"type": "string"}}}),
        |call| {
            let item = call.args["item"].as_str().ok_or("item must be a string")?;
            eprintln!(
                "[host] {} asked for {item} during call {}",
                call.session_id, call.execution_id
            );
            match item {
                "apple" => Ok(json!(0.5)),
                "pear" => Ok(json!(0.75)),
                other => Err(format!("no price for {other}")),
            }
        },
    )?;
    let shop = sup.session_with(SessionOptions {
        tools: vec![prices],
        ..SessionOptions::default()
    })?;
    let stats = sup.session()?;

    // Queue work in both sessions; they run in parallel.
    let a1 = shop.run("basket <- c(apple = 3, pear = 2)")?;
    let a2 = shop.run("total <- sum(sapply(names(basket), function(i) tools$lookup_price(item = i)) * basket)\ncat('total:', total, '\\n')")?;
    let b1 = stats.run("x <- rnorm(1000, mean = 10); summary(x)")?;
    let b2 = stats.run("rvisor_result(list(mean = mean(x), sd = sd(x)))")?;

    for (name, h) in [
        ("shop 1", a1),
        ("shop 2", a2),
        ("stats 1", b1),
        ("stats 2", b2),
    ] {
        let r = h.wait();
        println!("--- {name}: {} in {:.2} ms", r.outcome, r.duration_ms);
        print!("{}", r.console);
        if let Some(v) = r.result {
            println!("result: {v}");
        }
    }
    let err = shop.run("tools$lookup_price(item = 'kiwi')")?.wait();
    println!(
        "--- a failing tool: {}: {}",
        err.outcome,
        err.error.map(|e| e.message).unwrap_or_default()
    );
    Ok(())
}

//! The driver's parsing and checks, without a server.

use super::load::{admission_figures, parse_ok, Load, SessionSlot, SplitMix};
use serde_json::{json, Value};

#[test]
fn admission_figures_are_read_from_health() {
    let a = json!({"max_live_sessions": 50, "live_sessions": 7,
                   "memory_budget_bytes": 4096, "worker_memory_bytes": 3145728,
                   "refusals": {"live_sessions": 191}});
    assert_eq!(admission_figures(&a), (Some(3.0), Some(7)));
    assert_eq!(admission_figures(&json!({"max_sessions": 5})), (None, None));
}

#[test]
fn ok_lines_are_read_after_a_restore_notice() {
    let r = json!({"outcome": "complete",
                   "console": "rvisor: woke the session\nOK 3 -12.5 4 TRUE\n",
                   "session": {}});
    assert_eq!(parse_ok(&r).unwrap(), (3, "-12.5".into(), 4, true));
    let e = json!({"outcome": "error", "console": "", "error": {"message": "object 'x' not found"},
                   "session": {"reset_reason": null}});
    assert!(parse_ok(&e).unwrap_err().contains("object 'x' not found"));
}

fn answer(line: &str, fresh: bool) -> Value {
    json!({"outcome": "complete", "console": format!("{line}\n"),
           "session": {"fresh": fresh, "reset_reason": null, "restored": null}})
}

#[test]
fn verify_checks_index_sum_and_the_call_counter() {
    let mut slot = SessionSlot {
        sum: "-12.5".into(),
        calls: 1,
        ..SessionSlot::default()
    };
    assert!(Load::verify(&mut slot, 3, &answer("OK 3 -12.5 2 TRUE", false), false).is_ok());
    assert_eq!(slot.calls, 2);
    // Another session's state, another sum, a broken checksum, fresh.
    for (line, fresh) in [
        ("OK 4 -12.5 3 TRUE", false),
        ("OK 3 -12.49 3 TRUE", false),
        ("OK 3 -12.5 3 FALSE", false),
        ("OK 3 -12.5 3 TRUE", true),
    ] {
        let e = Load::verify(&mut slot, 3, &answer(line, fresh), false);
        assert!(e.is_err(), "{line} {fresh}");
    }
    // A restore from an older checkpoint: the counter went back.
    let e = Load::verify(&mut slot, 3, &answer("OK 3 -12.5 2 TRUE", false), false);
    assert!(e.unwrap_err().contains("lost calls"));
    // A call that may have run: one further is accepted, once.
    assert!(Load::verify(&mut slot, 3, &answer("OK 3 -12.5 4 TRUE", false), true).is_ok());
    assert_eq!(slot.calls, 4);
    assert!(!slot.maybe_one_more);
    assert!(Load::verify(&mut slot, 3, &answer("OK 3 -12.5 6 TRUE", false), false).is_err());
}

#[test]
fn shuffled_is_a_permutation() {
    let mut v = SplitMix(7).shuffled(100);
    v.sort_unstable();
    assert_eq!(v, (0..100).collect::<Vec<_>>());
}

//! Policy: one definition of each rule a request is checked against
//! (timeouts, limits a client may ask for, the names a run binds).

use super::{LimitsRequest, ServiceError};
use rvisor::SafetyRules;
use serde_json::Value;
use std::collections::HashSet;
use std::time::Duration;

/// Checks a requested timeout against the rules' range; `None` gives the
/// rules' default.
pub fn check_timeout(t: Option<f64>, rules: &SafetyRules) -> Result<Duration, ServiceError> {
    let r = &rules.timeout_seconds;
    match t {
        None => Ok(Duration::from_secs(r.default)),
        Some(t) if t.is_finite() && t >= r.min as f64 && t <= r.max as f64 => {
            Ok(Duration::from_secs_f64(t))
        }
        Some(t) => Err(ServiceError::invalid(format!(
            "timeout_seconds {t} is out of range: use {}..{} seconds",
            r.min, r.max
        ))),
    }
}

/// The server's limits tightened by `asked`; a looser value is refused.
/// `base` is `None` when the server runs unconfined.
pub fn tighter_limits(
    base: Option<&rvisor::Limits>,
    asked: Option<&LimitsRequest>,
) -> Result<Option<rvisor::Limits>, ServiceError> {
    let Some(b) = asked else { return Ok(None) };
    let Some(base) = base else {
        return Err(ServiceError::invalid(
            "limits need OS confinement, and this server runs unconfined",
        ));
    };
    let mut l = base.clone();
    let over = |what: &str, asked: u64, max: u64, unit: &str| {
        ServiceError::invalid(format!(
            "{what} {asked}{unit} is over the server's limit of {max}{unit}; ask for less"
        ))
    };
    if let Some(m) = b.memory_mb {
        if m > base.memory_bytes >> 20 {
            return Err(over("memory_mb", m, base.memory_bytes >> 20, " MiB"));
        }
        l.memory_bytes = m << 20;
    }
    if let Some(d) = b.disk_mb {
        if d > base.disk_bytes >> 20 {
            return Err(over("disk_mb", d, base.disk_bytes >> 20, " MiB"));
        }
        l.disk_bytes = d << 20;
    }
    if let Some(p) = b.processes {
        if p > base.processes {
            return Err(over("processes", p, base.processes, ""));
        }
        l.processes = p;
    }
    if let Some(c) = b.cpu_seconds {
        if let Some(max) = base.cpu_seconds.filter(|max| c > *max) {
            return Err(over("cpu_seconds", c, max, " s"));
        }
        l.cpu_seconds = Some(c);
    }
    l.check()
        .map_err(|e| ServiceError::invalid(e.to_string()))?;
    Ok(Some(l))
}

/// Checks the names a one-shot run binds: at most `max_dataframes` tables,
/// syntactic names, the variables' own rules (422 `invalid`: the request
/// schema states them), and no name used twice (between variables, between
/// tables, or between a table and a variable: 409 `conflict`, which no
/// schema can state).
pub fn check_bindings(
    variables: &[(String, Value)],
    table_names: &[&str],
    rules: &SafetyRules,
) -> Result<(), ServiceError> {
    if table_names.len() > rules.max_dataframes {
        return Err(ServiceError::invalid(format!(
            "{} dataframes given; at most {} are allowed",
            table_names.len(),
            rules.max_dataframes
        )));
    }
    for n in table_names {
        if let Some(why) = rvisor::ops::name_problem(n) {
            return Err(ServiceError::invalid(format!("dataframe name: {why}")));
        }
    }
    rvisor::ops::check_variables(variables, rules).map_err(|e| match e {
        rvisor::VariableError::Duplicate(n) => ServiceError::conflict(format!(
            "variable {n:?} is given twice; give each name once"
        )),
        e => ServiceError::invalid(e.to_string()),
    })?;
    let mut names = HashSet::new();
    for n in table_names {
        if !names.insert(*n) || variables.iter().any(|(v, _)| v == n) {
            return Err(ServiceError::conflict(format!(
                "the name {n:?} is used twice (by variables and dataframes); give each name once"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::ErrorCode;
    use serde_json::json;

    #[test]
    fn timeouts_follow_the_rules_range() {
        let rules = SafetyRules::default();
        let r = &rules.timeout_seconds;
        assert_eq!(
            check_timeout(None, &rules),
            Ok(Duration::from_secs(r.default))
        );
        assert!(check_timeout(Some(r.min as f64), &rules).is_ok());
        assert!(check_timeout(Some(r.max as f64), &rules).is_ok());
        for bad in [0.0, r.max as f64 + 1.0, f64::NAN, f64::INFINITY, -1.0] {
            let e = check_timeout(Some(bad), &rules).unwrap_err();
            assert_eq!(e.code, ErrorCode::Invalid);
            assert!(e.message.contains("timeout_seconds"), "{}", e.message);
        }
    }

    #[test]
    fn limits_only_tighten() {
        let base = rvisor::Limits::default();
        assert_eq!(tighter_limits(Some(&base), None), Ok(None));
        let tighter = LimitsRequest {
            memory_mb: Some(1024),
            ..Default::default()
        };
        let l = tighter_limits(Some(&base), Some(&tighter))
            .unwrap()
            .unwrap();
        assert_eq!(l.memory_bytes, 1024 << 20);
        let looser = LimitsRequest {
            processes: Some(base.processes + 1),
            ..Default::default()
        };
        let e = tighter_limits(Some(&base), Some(&looser)).unwrap_err();
        assert!(
            e.message.contains("over the server's limit"),
            "{}",
            e.message
        );
        let e = tighter_limits(None, Some(&tighter)).unwrap_err();
        assert!(e.message.contains("unconfined"), "{}", e.message);
    }

    #[test]
    fn bindings_refuse_reused_and_bad_names() {
        let rules = SafetyRules::default();
        let vars = vec![("n".to_string(), json!(1))];
        assert!(check_bindings(&vars, &["d"], &rules).is_ok());
        for (tables, what, code) in [
            (vec!["n"], "used twice", ErrorCode::Conflict),
            (vec!["d", "d"], "used twice", ErrorCode::Conflict),
            (vec!["1x"], "not a syntactic R name", ErrorCode::Invalid),
        ] {
            let e = check_bindings(&vars, &tables, &rules).unwrap_err();
            assert!(e.message.contains(what), "{tables:?}: {}", e.message);
            assert_eq!(e.code, code, "{tables:?}");
        }
        let twice = vec![("n".to_string(), json!(1)), ("n".to_string(), json!(2))];
        let e = check_bindings(&twice, &[], &rules).unwrap_err();
        assert_eq!(e.code, ErrorCode::Conflict, "{}", e.message);
        assert!(e.message.contains("given twice"), "{}", e.message);
        let many: Vec<String> = (0..=rules.max_dataframes)
            .map(|i| format!("d{i}"))
            .collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(check_bindings(&[], &many, &rules).is_err());
    }
}

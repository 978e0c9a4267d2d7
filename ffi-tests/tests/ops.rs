//! Health, packages and validation (which runs nothing) against real R.

use rvisor::{PoolConfig, SafetyRules, Supervisor, SupervisorConfig};

fn sup_with(rules: SafetyRules) -> Supervisor {
    Supervisor::new(SupervisorConfig {
        rules,
        style: rvisor::StyleEngine::Builtin,
        pool: PoolConfig {
            zygote: true,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        ..SupervisorConfig::default()
    })
    .expect("supervisor")
}

fn sup() -> Supervisor {
    sup_with(SafetyRules::default())
}

#[test]
fn empty_and_oversized_scripts_are_problems() {
    let s = sup_with(SafetyRules {
        max_script_bytes: 100,
        ..SafetyRules::default()
    });
    let v = s.validate("  \n");
    assert!(!v.valid);
    assert_eq!(v.problems[0].kind, "empty");
    let v = s.validate(&"x <- 1\n".repeat(50));
    assert_eq!(v.problems[0].kind, "size");
    assert!(v.problems[0].message.contains("100 bytes"));
}

#[test]
fn syntax_errors_come_from_r_with_positions() {
    let v = sup().validate("x <- 1\ny <- (2 +\nz <- 3 3");
    assert!(!v.valid);
    let p = &v.problems[0];
    assert_eq!(p.kind, "syntax");
    assert_eq!((p.line, p.column), (Some(3), Some(8)));
    assert!(p.message.contains("unexpected"));
}

#[test]
fn forbidden_functions_are_found_in_every_form() {
    let script = "a <- system('id')\n\
                  b <- base::system2('id')\n\
                  c <- base:::pipe('id')\n\
                  d <- do.call('system', list('id'))\n\
                  e <- match.fun(\"system\")\n\
                  f <- getExportedValue('base', 'system')\n\
                  g <- system\n\
                  h <- sum(1:3)\n";
    let v = sup().validate(script);
    assert!(!v.valid);
    let lines: Vec<u32> = v
        .problems
        .iter()
        .filter(|p| p.kind == "forbidden")
        .filter_map(|p| p.line)
        .collect();
    for line in 1..=7 {
        assert!(
            lines.contains(&line),
            "line {line} not flagged: {:?}",
            v.problems
        );
    }
    assert!(!lines.contains(&8));
    let first = &v.problems[0];
    assert_eq!((first.line, first.column), (Some(1), Some(6)));
    assert!(first.message.contains("system"));
}

#[test]
fn computed_names_are_warnings_not_problems() {
    let v = sup().validate("f <- get(paste0('sys', 'tem'))\nx <- do.call(f, list())\n");
    assert!(v.valid, "{:?}", v.problems);
    assert_eq!(v.warnings.len(), 2, "{:?}", v.warnings);
    assert!(v.warnings[0].message.contains("computed"));
    assert_eq!(v.warnings[0].line, Some(1));
}

#[test]
fn nesting_over_the_limit_is_a_problem() {
    let s = sup_with(SafetyRules {
        max_nesting_depth: 5,
        ..SafetyRules::default()
    });
    let v = s.validate("x <- f(g(h(i(j(k(l(1)))))))");
    assert!(!v.valid);
    assert_eq!(v.problems[0].kind, "nesting");
    assert!(s.validate("x <- f(1)").valid);
}

#[test]
fn style_notes_never_block() {
    let v = sup().validate(&format!("x = T  \ny <- {}\n", "1 + ".repeat(30) + "1"));
    assert!(v.valid);
    let rules: Vec<&str> = v.style.iter().map(|s| s.rule.as_str()).collect();
    for r in [
        "assignment",
        "T_and_F_symbol",
        "trailing_whitespace",
        "line_length",
    ] {
        assert!(rules.contains(&r), "{r} missing: {rules:?}");
    }
    assert_eq!(v.style_engine, "builtin");
}

#[test]
fn validation_runs_nothing() {
    // Confined (the default): a script that would end the validator if it
    // ran (quit is allowed here so that the script itself is valid). The
    // validator would then fail twice and validation report a problem.
    let s = sup_with(SafetyRules {
        forbidden_functions: Vec::new(),
        ..SafetyRules::default()
    });
    for _ in 0..2 {
        let v = s.validate("quit(save = 'no', status = 3)");
        assert!(v.valid, "validation evaluated the script: {:?}", v.problems);
        assert!(v.problems.is_empty(), "{:?}", v.problems);
    }

    // Unconfined on purpose: the proof here is a host file the script would
    // create, which a confined validator could not create anyway.
    let s = Supervisor::new(SupervisorConfig {
        style: rvisor::StyleEngine::Builtin,
        confinement: rvisor::Confinement::unconfined(),
        ..SupervisorConfig::default()
    })
    .expect("supervisor");
    let marker =
        std::env::temp_dir().join(format!("rvisor-validate-{}", rvisor::ids::random_hex(6)));
    let v = s.validate(&format!("file.create('{}')", marker.display()));
    assert!(v.valid);
    assert!(!marker.exists(), "validation must not evaluate the script");
}

#[test]
fn health_reports_the_live_rules() {
    let rules = SafetyRules {
        max_nesting_depth: 7,
        forbidden_functions: vec!["foo".into()],
        ..SafetyRules::default()
    };
    let s = sup_with(rules.clone());
    let h = s.health();
    assert_eq!(h.status, "ok");
    assert_eq!(h.rules, rules);
    assert_eq!(h.r_version.split('.').count(), 3, "{}", h.r_version);
    let v = serde_json::to_value(&h).unwrap();
    for key in [
        "max_script_bytes",
        "max_nesting_depth",
        "forbidden_functions",
        "timeout_seconds",
        "max_dataframes",
        "max_variables",
    ] {
        assert!(v["rules"].get(key).is_some(), "rules.{key}");
    }
    assert_eq!(v["rules"]["timeout_seconds"]["max"], 300);
    // The validator uses the same rules.
    assert!(!s.validate("foo(1)").valid);
    assert!(s.validate("system('id')").valid);
}

#[test]
fn packages_lists_what_library_can_load() {
    let list = sup().packages().expect("packages");
    for name in ["base", "stats", "utils", "ggplot2"] {
        let p = list
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert!(!p.version.is_empty());
        assert!(
            std::path::Path::new(&p.library).join(name).is_dir(),
            "{}",
            p.library
        );
    }
    let mut names: Vec<&str> = list.iter().map(|p| p.name.as_str()).collect();
    let n = names.len();
    names.dedup();
    assert_eq!(names.len(), n, "one entry per package");
}

#[test]
fn lintr_gives_the_style_notes_when_installed() {
    // setup.sh installs r-cran-lintr, so `--style lintr` uses it here.
    let s = Supervisor::new(SupervisorConfig {
        pool: PoolConfig {
            zygote: true,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        style: rvisor::StyleEngine::Lintr,
        ..SupervisorConfig::default()
    })
    .expect("supervisor");
    let script = "x = 1\ny <- T\nif (x & y) print(x)\n";
    let v = s.validate(script);
    assert!(v.valid);
    assert!(v.style_engine.starts_with("lintr "), "{}", v.style_engine);
    let rules: Vec<&str> = v.style.iter().map(|n| n.rule.as_str()).collect();
    assert!(rules.contains(&"assignment_linter"), "{rules:?}");
    assert!(rules.contains(&"T_and_F_symbol_linter"), "{rules:?}");
    // The default engine (rvisor-lint, through the service) gives the same
    // notes as lintr for this script.
    let default = Supervisor::new(SupervisorConfig {
        pool: PoolConfig {
            zygote: true,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        ..SupervisorConfig::default()
    })
    .expect("supervisor");
    let fast = rvisor_server::service::validate(&default, script);
    assert!(
        fast.style_engine.starts_with("rvisor-lint "),
        "{}",
        fast.style_engine
    );
    assert_eq!(fast.style, v.style);
    // A run checks problems only: no style work on the request path.
    let v = s.validate_with("x = 1\n", rvisor::StyleEngine::None);
    assert!(v.style.is_empty());
}

#[test]
fn the_default_engine_is_rvisor_lint_and_syntax_stays_r_s() {
    let s = Supervisor::new(SupervisorConfig {
        pool: PoolConfig {
            zygote: true,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        ..SupervisorConfig::default()
    })
    .expect("supervisor");
    let v = rvisor_server::service::validate(&s, "x = 1; y <- 2\n");
    assert!(v.valid);
    assert_eq!(v.style_engine, rvisor_lint::engine());
    let rules: Vec<&str> = v.style.iter().map(|n| n.rule.as_str()).collect();
    assert_eq!(rules, ["assignment_linter", "semicolon_linter"]);
    // Blocking problems are R's parser's, as before.
    let v = rvisor_server::service::validate(&s, "x <- (1 +\n");
    assert!(!v.valid);
    assert_eq!(v.problems[0].kind, "syntax");
    let v = rvisor_server::service::validate(&s, "f(x))\n");
    assert_eq!(v.problems[0].message, "unexpected ')'");
    assert_eq!(
        (v.problems[0].line, v.problems[0].column),
        (Some(1), Some(5))
    );
}

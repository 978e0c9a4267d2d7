//! The `rvisor` command line: run (console, --json, --var, --plots-dir,
//! exit codes), validate and health.

use std::path::PathBuf;
use std::process::{Command, Stdio};

fn rvisor() -> Command {
    Command::new(rvisor_ffi_tests::rvisor_bin())
}

fn script(text: &str) -> Script {
    let p = std::env::temp_dir().join(format!("rvisor-cli-{}.R", rvisor::ids::random_hex(6)));
    std::fs::write(&p, text).unwrap();
    Script(p)
}

/// A script file in the temporary directory, removed when dropped (every
/// run of this suite left ~20 of them behind).
struct Script(PathBuf);

impl std::ops::Deref for Script {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Script {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Script {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A command that ends leaves no directory of its zygote or workers in the
/// temporary directory: each `rvisor run` and `session --jsonl` left one
/// (the zygote's, with R's tempdir() in it) while threads still held the
/// zygote when the process exited, and a worker being ended after a reset
/// (or a spare being forked) could leave its own.
#[test]
fn commands_leave_nothing_in_the_temporary_directory() {
    let tmp = std::env::temp_dir().join(format!("rvisor-cli-tmp-{}", rvisor::ids::random_hex(6)));
    std::fs::create_dir(&tmp).unwrap();
    // Confined workers (their own uids) reach their directory below it.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
    let f = script("plot(1:3); cat(file.exists(tempdir()), '\n')\n");
    let left = || -> Vec<String> {
        std::fs::read_dir(&tmp)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect()
    };
    let out = rvisor()
        .arg("run")
        .arg(&f)
        .env("TMPDIR", &tmp)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "TRUE");
    assert_eq!(left(), Vec::<String>::new(), "after rvisor run");
    let mut child = rvisor()
        .args(["session", "--jsonl"])
        .env("TMPDIR", &tmp)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, r#"{{"id":1,"op":"run","code":"plot(1); 1 + 1"}}"#).unwrap();
        // A reset ends the worker on a thread of its own: the process
        // exits while it may still be ending (its directory was left).
        writeln!(stdin, r#"{{"id":2,"op":"reset"}}"#).unwrap();
        writeln!(stdin, r#"{{"id":3,"op":"run","code":"2"}}"#).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains(r#""outcome":"complete""#));
    assert_eq!(left(), Vec::<String>::new(), "after session --jsonl");
    let _ = std::fs::remove_dir(&tmp);
}

#[test]
fn run_prints_the_console_and_exits_zero_on_success() {
    let f = script("cat('hello\\n'); 1 + 1\n");
    let out = rvisor().arg("run").arg(&f).output().unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hello\n[1] 2\n");
}

#[test]
fn run_exits_one_on_an_r_error_and_prints_it_on_stderr() {
    let f = script("stop('boom')\n");
    let out = rvisor().arg("run").arg(&f).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("Error: boom"));
}

#[test]
fn run_json_has_the_contract_fields_and_variables_are_bound() {
    let f = script("n * 2; class(n); s; flag; length(v)\n");
    let out = rvisor()
        .args([
            "run",
            "--json",
            "--var",
            "n=21",
            "--var",
            "s=hi",
            "--var",
            "flag=true",
            "--var",
            "v=[1,2,3]",
        ])
        .arg(&f)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for key in rvisor_ffi_tests::RUN_RESULT_FIELDS {
        assert!(r.get(key).is_some(), "missing {key}");
    }
    assert_eq!(r["outcome"], "complete");
    assert_eq!(
        r["console"],
        "[1] 42\n[1] \"integer\"\n[1] \"hi\"\n[1] TRUE\n[1] 3\n"
    );
}

#[test]
fn run_rejects_a_bad_variable_name() {
    let f = script("1\n");
    let out = rvisor()
        .args(["run", "--var", "1x=2"])
        .arg(&f)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("syntactic"));
}

#[test]
fn run_refuses_a_20000_byte_variable_name_before_r_sees_it() {
    let f = script("cat('ran')\n");
    let var = format!("{}=3", "a".repeat(20_000));
    let out = rvisor()
        .args(["run", "--var", &var])
        .arg(&f)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("10000 bytes"), "{err}");
    assert!(
        err.len() < 1000,
        "the name is echoed whole: {} bytes",
        err.len()
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("ran"));
}

#[test]
fn run_writes_plots_to_the_plots_dir() {
    let dir = std::env::temp_dir().join(format!("rvisor-cli-plots-{}", rvisor::ids::random_hex(6)));
    let f = script("plot(1:3); hist(rnorm(10))\n");
    let out = rvisor()
        .arg("run")
        .arg(&f)
        .arg("--plots-dir")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    for name in ["plot-001.png", "plot-002.png"] {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        assert_eq!(&bytes[..4], b"\x89PNG");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn run_reads_the_script_from_stdin() {
    let mut child = rvisor()
        .args(["run", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"cat(6 * 7)")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "42");
}

#[test]
fn validate_exit_code_and_positions() {
    let f = script("x <- 1\nsystem('id')\n");
    let out = rvisor().arg("validate").arg(&f).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(":2:1: error [forbidden]"), "{text}");
    let ok = script("x <- 1\n");
    assert!(rvisor()
        .arg("validate")
        .arg(&ok)
        .output()
        .unwrap()
        .status
        .success());
}

#[test]
fn health_json_lists_the_rules() {
    let out = rvisor().args(["health", "--json"]).output().unwrap();
    assert!(out.status.success());
    let h: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["rules"]["timeout_seconds"]["max"], 300);
    assert!(h["rules"]["forbidden_functions"]
        .as_array()
        .unwrap()
        .iter()
        .any(|f| f == "system"));
}

#[test]
fn run_uses_the_current_directory_only_when_unconfined_or_exposed() {
    // Readable by everyone: a confined worker runs as its own uid.
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rvisor-cli-cwd-{}", rvisor::ids::random_hex(6)));
    std::fs::create_dir_all(&dir).unwrap();
    let dir = dir.canonicalize().unwrap();
    std::fs::write(dir.join("data.txt"), "x\n").unwrap();
    let f = script(&format!(
        "cat(file.exists('data.txt'), normalizePath(getwd()) == '{}', \
         suppressWarnings(file.create('new.txt')))\n",
        dir.display()
    ));
    let run = |extra: &[&str]| {
        let out = rvisor()
            .args(extra)
            .arg("run")
            .arg(&f)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{extra:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    // Confined (the default): the script runs in its private directory.
    assert_eq!(run(&[]), "FALSE FALSE TRUE");
    // Exposed read-only: it runs in the current directory and reads it,
    // but cannot write there.
    let ro = dir.display().to_string();
    assert_eq!(run(&["--read-only", &ro]), "TRUE TRUE FALSE");
    assert!(!dir.join("new.txt").exists());
    // Unconfined (trusted code): the current directory, writable.
    assert_eq!(run(&["--unconfined"]), "TRUE TRUE TRUE");
    assert!(dir.join("new.txt").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_loads_what_rscript_loads_and_gc_counts_few_cells_of_rvisors_own() {
    // A user's gc() counts the driver's objects too (docs/r-semantics.md,
    // "The corpus"): kept small. The driver's rarely used parts
    // (validation, checkpoints) stay text until first used; attaching its
    // helpers leaves no caches of the methods package; no closure of the
    // driver or of its program guard is called twice before user code
    // (R's JIT would compile it, and a worker's first compile forces most
    // of the compiler's lazily loaded functions, some 56,000 cons cells).
    // Measured on R 4.2: 11,051 cons cells and 12,834 vector cells more
    // than Rscript before, 5,727 and 6,376 after; 8,036 and 6,742 with the
    // program guard's code (the allow-list of programs), which every
    // confined worker holds. On Debian's R here: 8,899 and 8,474, then
    // 9,012 and 9,204 with the host-side parts (install.packages through
    // the server, readline through a front end) kept as text until first
    // used (their text is the vector cells); 9,550 cons cells with the
    // plot hooks that tell a page from a panel and the replayed page that
    // got only settings; 8,509 and 7,712 with the parts' names read at
    // build time (no parse and no bquote() at start).
    let f = script(
        "invisible(gc()); g <- gc()
         cat(g[1, 1], g[2, 1], '\n')
         cat(sort(loadedNamespaces()), '\n')
",
    );
    let counts = |out: std::process::Output, who: &str| {
        assert!(
            out.status.success(),
            "{who}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let mut lines = text.lines();
        let cells: Vec<i64> = lines
            .next()
            .unwrap_or_default()
            .split_whitespace()
            .map(|n| n.parse().expect("a count"))
            .collect();
        (cells, lines.next().unwrap_or_default().to_string())
    };
    let (ours, ns) = counts(rvisor().arg("run").arg(&f).output().unwrap(), "rvisor");
    let rscript = Command::new("Rscript")
        .arg("--vanilla")
        .arg(&f)
        .env("LANG", "C.UTF-8")
        .output()
        .unwrap();
    let (theirs, rns) = counts(rscript, "Rscript");
    assert_eq!(ns, rns, "loaded namespaces");
    let (n, v) = (ours[0] - theirs[0], ours[1] - theirs[1]);
    assert!((0..10_000).contains(&n), "{n} cons cells more than Rscript");
    assert!(
        (0..10_000).contains(&v),
        "{v} vector cells more than Rscript"
    );
}

#[test]
fn the_driver_parses_to_the_same_code_without_its_comment_lines() {
    // The worker gives R the driver and its parts without their comment
    // lines (r.rs, `without_comment_lines`): a line of a string running
    // over lines that began with `#` would be lost. R says whether each
    // file parses to the same expressions either way.
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../embedded-worker/src");
    let mut files: Vec<_> = std::fs::read_dir(&src)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("driver") && n.ends_with(".R"))
        })
        .collect();
    files.sort();
    assert!(files.len() >= 2, "the driver's files in {}", src.display());
    for f in files {
        let out = Command::new("Rscript")
            .arg("--vanilla")
            .arg("-e")
            .arg(
                "txt <- readLines(commandArgs(TRUE)[1], encoding = 'UTF-8')
                 kept <- txt[!grepl('^[[:space:]]*#', txt)]
                 a <- parse(text = txt, keep.source = FALSE, encoding = 'UTF-8')
                 b <- parse(text = kept, keep.source = FALSE, encoding = 'UTF-8')
                 cat(identical(a, b), length(a), length(txt) - length(kept))",
            )
            .arg(&f)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            said.starts_with("TRUE "),
            "{}: {said} {}",
            f.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn r_starts_with_the_state_rscripts_start_gives() {
    // The worker loads R's default packages itself, after R's start-up,
    // answering utils' two shell commands for osVersion from uname(2) and
    // the PATH (embedded-worker/src/start.R): what a script sees of the
    // start is Rscript's, but for the attached "rvisor" environment (by
    // design, docs/r-semantics.md), and a confined worker's program guard.
    let f = script(
        "cat(utils::osVersion, '\\n')
         cat(setdiff(search(), 'rvisor'), '\\n')
         cat(getOption('defaultPackages'), '\\n')
         cat(loadedNamespaces(), '\\n')
         cat(compiler::enableJIT(-1), '\\n')
         cat(Sys.getenv(c('R_DEFAULT_PACKAGES', 'R_ENABLE_JIT'), unset = 'unset'), '\\n')
         cat(sessionInfo()$running, '\\n')
         cat(bindingIsLocked('system', baseenv()), bindingIsLocked('Sys.which', baseenv()), '\\n')
         cat(nzchar(Sys.which('uname')), '\\n')
",
    );
    let g = script(
        "cat(identical(environment(system), baseenv()), '\\n')
         cat(identical(deparse(system), deparse(get('system', .BaseNamespaceEnv))), '\\n')
         cat(deparse(body(Sys.which))[1:3], sep = '\\n')
",
    );
    let out = |mut c: Command, what: &str| {
        let out = c.env("LANG", "C.UTF-8").output().unwrap();
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let rscript = |f: &std::path::Path| {
        let mut c = Command::new("Rscript");
        c.arg("--vanilla").arg(f);
        out(c, "Rscript")
    };
    let theirs = rscript(&f);
    assert!(theirs.contains("utils"), "{theirs}");
    let mut confined = rvisor();
    confined.args(["--allow-program", "uname", "run"]).arg(&f);
    assert_eq!(out(confined, "confined"), theirs);
    let mut unconfined = rvisor();
    unconfined.args(["--unconfined", "run"]).arg(&f);
    assert_eq!(out(unconfined, "unconfined"), theirs);
    // Unconfined, base's system() and Sys.which() are R's own again.
    let mut unconfined = rvisor();
    unconfined.args(["--unconfined", "run"]).arg(&g);
    assert_eq!(out(unconfined, "unconfined"), rscript(&g));
}

/// `rvisor run`'s worker lives for one call, so R's malloc takes its
/// memory in transparent huge pages (WorkerConfig::malloc_huge_pages: a
/// quarter of the page faults while R starts), through a glibc tunable
/// that R code does not see; Rscript's R, with glibc's default, has none
/// where the kernel gives huge pages only to memory that asks for them.
#[test]
fn run_gives_r_huge_pages_without_showing_the_tunable() {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if !thp.contains("[madvise]") && !thp.contains("[always]") {
        eprintln!("skipped: this kernel gives no transparent huge pages ({thp:?})");
        return;
    }
    let f = script(
        "cat(Sys.getenv('GLIBC_TUNABLES', unset = 'unset'), '\\n')
         x <- numeric(4e6); x[] <- 1
         l <- grep('^AnonHugePages', readLines('/proc/self/smaps_rollup'), value = TRUE)
         cat(as.numeric(gsub('[^0-9]', '', l)), '\\n')
",
    );
    let huge_kb = |mut c: Command, what: &str| -> u64 {
        let out = c.output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        assert_eq!(lines.len(), 2, "{what}: {text}");
        assert_eq!(lines[0], "unset", "{what}: R code sees the tunable");
        lines[1].parse().unwrap()
    };
    let mut confined = rvisor();
    confined.arg("run").arg(&f);
    let confined = huge_kb(confined, "confined");
    let mut unconfined = rvisor();
    unconfined.args(["--unconfined", "run"]).arg(&f);
    let unconfined = huge_kb(unconfined, "unconfined");
    // The 32 MB vector alone spans 14 aligned 2 MiB pages (45-78 MB in
    // huge pages here); at least one, as a fragmented host may give 4 KiB
    // pages for some (without the tunable: none).
    for (what, kb) in [("confined", confined), ("unconfined", unconfined)] {
        assert!(kb >= 2048, "{what}: {kb} kB in huge pages");
    }
    if thp.contains("[madvise]") {
        let mut c = Command::new("Rscript");
        c.arg("--vanilla").arg(&f);
        assert_eq!(huge_kb(c, "Rscript"), 0);
    }
}

#[test]
fn run_finds_the_callers_project_root_as_rscript_does_once_the_project_is_exposed() {
    // here::here() and rprojroot walk up from the working directory to
    // the first directory holding DESCRIPTION, .git, *.Rproj...; the same
    // walk in base R. Confined (the default), the script runs in its
    // private directory and finds nothing; with the project exposed
    // (--read-only PROJECT) it runs in the caller's directory, sees its
    // parents up to the project, and finds what Rscript finds
    // (docs/r-semantics.md, "The corpus").
    let project = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rvisor-cli-project-{}", rvisor::ids::random_hex(6)));
    let sub = project.join("analysis");
    std::fs::create_dir_all(&sub).unwrap();
    let project = project.canonicalize().unwrap();
    std::fs::write(project.join("DESCRIPTION"), "Package: p\n").unwrap();
    let f = script(
        "root <- function(d = normalizePath(getwd())) {\n\
           while (!file.exists(file.path(d, 'DESCRIPTION'))) {\n\
             if (dirname(d) == d) return(NA)\n\
             d <- dirname(d)\n\
           }\n\
           d\n\
         }\n\
         cat(root())\n",
    );
    let out = |mut c: Command| {
        let out = c.current_dir(project.join("analysis")).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let mut rscript = Command::new("Rscript");
    rscript.arg("--vanilla").arg(&f);
    let found = project.display().to_string();
    assert_eq!(out(rscript), found);
    let mut confined = rvisor();
    confined.arg("run").arg(&f);
    assert_eq!(out(confined), "NA");
    let mut exposed = rvisor();
    exposed.args(["--read-only", &found, "run"]).arg(&f);
    assert_eq!(out(exposed), found);
    let _ = std::fs::remove_dir_all(&project);
}

#[test]
fn run_prints_a_programs_output_on_stdout_as_rscript_does() {
    // A program system() runs writes to the worker's own standard output
    // (raw output, attached to the result after the call's console text);
    // under Rscript it is standard output: `rvisor run x.R > out` keeps it
    // (the corpus found glue's shell transformer's output on stderr).
    let f = script("cat('before\\n'); system('echo from-sh'); cat('after\\n')\n");
    let out = rvisor()
        .args(["--allow-program", "cat", "run"])
        .arg(&f)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("before\nafter\n"), "{stdout}");
    assert!(
        stdout.contains("from-sh\n"),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    assert!(!stderr.contains("from-sh"), "{stderr}");
}

#[test]
fn run_writes_timing_marks_in_causal_order_when_asked() {
    let f = script("1 + 1\n");
    let marks =
        std::env::temp_dir().join(format!("rvisor-cli-marks-{}", rvisor::ids::random_hex(6)));
    let out = rvisor()
        .arg("run")
        .arg(&f)
        .env("RVISOR_TIMING", &marks)
        .output()
        .unwrap();
    assert!(out.status.success());
    // The output is the same as without marks.
    assert_eq!(String::from_utf8_lossy(&out.stdout), "[1] 2\n");
    let text = std::fs::read_to_string(&marks).unwrap();
    std::fs::remove_file(&marks).unwrap();
    let at = |label: &str| -> u128 {
        text.lines()
            .find(|l| l.split_whitespace().nth(2) == Some(label))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("no {label} mark in:\n{text}"))
    };
    // The CLI, the supervisor and the zygote (another process) all mark,
    // each step after the one it waits for.
    // The labels are `rvisor::timing`'s, which `rvisor bench` splits by:
    // every process must write the same ones.
    use rvisor::timing as t;
    let order = [
        t::CLI_MAIN,
        t::SUPERVISOR_NEW,
        t::SUPERVISOR_PROBED,
        t::ZYGOTE_LAUNCH,
        t::WORKER_MAIN,
        t::WORKER_R_START,
        t::WORKER_R_STARTED,
        t::WORKER_WARM_UP,
        t::WORKER_WARMED_UP,
        t::ZYGOTE_HELLO,
        t::FORK_REQUEST,
        t::FORK_FORKED,
        t::FORK_READY,
        t::RUN_ONCE_CALL,
        t::RUN_ONCE_RESULT,
        t::SUPERVISOR_SHUTDOWN,
        t::SUPERVISOR_SHUT,
        t::CLI_EXIT,
    ];
    for w in order.windows(2) {
        assert!(at(w[0]) <= at(w[1]), "{} after {}:\n{text}", w[0], w[1]);
    }
    let pid_of = |label: &str| {
        text.lines()
            .find(|l| l.split_whitespace().nth(2) == Some(label))
            .and_then(|l| l.split_whitespace().nth(1))
            .map(str::to_string)
    };
    assert_ne!(pid_of(t::CLI_MAIN), pid_of(t::WORKER_R_STARTED));
    for label in [
        t::SUPERVISOR_READY,
        t::RUN_ONCE_ACQUIRE,
        t::RUN_ONCE_ACQUIRED,
    ] {
        at(label);
    }
}

#[test]
fn bench_prints_the_startup_and_batch_rows() {
    let out = rvisor()
        .args([
            "bench",
            "--only",
            "startup,batch",
            "--reps",
            "1",
            "--scripts",
            "3",
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for title in [
        "`rvisor session --jsonl`: start -> first `1+1` result line",
        "`rvisor serve`: start -> first `POST /v1/run` `1+1` answered",
        "`rvisor run one.R` (`1+1`) whole process",
        "first_ggplot_new_session",
        "R init (setup_Rmainloop",
        "R help examples, ",
    ] {
        assert!(stdout.contains(title), "no {title:?} in:\n{stdout}");
    }
    let json = stdout.lines().last().unwrap();
    let report: serde_json::Value = serde_json::from_str(json).unwrap();
    let rows = report["startup"]["rows"].as_array().unwrap();
    for id in ["rscript", "session_jsonl", "serve", "run", "run_unconfined"] {
        let row = rows.iter().find(|r| r["workload"] == id).unwrap();
        assert!(row["median_ms"].as_f64().is_some(), "{id}: {row}");
    }
    let batch = &report["batch"];
    assert_eq!(batch["scripts"], 3, "{batch}");
    assert!(batch["rvisor"]["median_ms"].as_f64().is_some(), "{batch}");
    assert!(batch["rscript"]["median_ms"].as_f64().is_some(), "{batch}");
    // The chosen scripts all succeed under Rscript.
    assert_eq!(batch["rscript_ok"], 3, "{batch}");
}

/// `rvisor run` prints output as it comes: R prints a line, then waits
/// for a file the test writes only after it has read that line from the
/// command's stdout (a run that printed at the end would never end).
#[test]
fn run_prints_output_as_it_comes() {
    use std::io::BufRead;
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rvisor-cli-live-{}", rvisor::ids::random_hex(6)));
    std::fs::create_dir_all(&dir).unwrap();
    let f = script(
        "cat('first\\n'); while (!file.exists('go')) Sys.sleep(0.005); \
         cat('second\\n'); message('note'); 1 + 1\n",
    );
    let mut child = rvisor()
        .args(["--unconfined", "run"])
        .arg(&f)
        .args(["--timeout", "60"])
        .current_dir(&dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "first\n");
    std::fs::write(dir.join("go"), "").unwrap();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{err}");
    assert_eq!(rest, "second\n[1] 2\n");
    assert_eq!(err.matches("note\n").count(), 1, "printed once: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_shows_no_result_block_live_and_keeps_the_text_around_it() {
    // The block is the result's `result`, removed from its console; the
    // live output leaves it out too (it used to be printed, then removed).
    let f = script(
        "cat('before\\n'); rvisor_result(list(a = 1)); cat('after\\n')
         cat('<<<RVISOR_RESULT_START>>>\\nunterminated\\n')
",
    );
    let out = rvisor().arg("run").arg(&f).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("\"a\""), "the block was shown: {stdout}");
    // An unterminated block is no block: its text is kept, as in the result.
    assert_eq!(
        stdout, "before\nafter\n<<<RVISOR_RESULT_START>>>\nunterminated\n",
        "{stdout}"
    );
    let json = rvisor().arg("run").arg("--json").arg(&f).output().unwrap();
    let r: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert!(r["result"].is_null(), "the last block is unterminated: {r}");
}

#[test]
fn a_reader_that_went_away_ends_a_report_quietly_not_with_a_panic() {
    // `rvisor health | head -1`, `rvisor run x.R | head`: the reader may
    // close before the output is written. Here it has closed before the
    // command starts, so every write meets a broken pipe.
    let f = script("for (i in 1:200) print(i)\n");
    let f = f.to_str().unwrap();
    for args in [
        &["health"][..],
        &["health", "--json"],
        &["packages"],
        &["run", f],
        &["run", "--json", f],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = rvisor()
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("Broken pipe"), "{args:?}: {err}");
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
    }
}

//! `rvisor kernel` end to end through real Jupyter clients: each test runs
//! one scenario of `tests/jupyter/check.py` with jupyter_client (pyzmq on
//! libzmq) or nbclient, which install the kernelspec, start the kernel as
//! every front end does and check what it answers.

use rvisor_ffi_tests::rvisor_bin;
use std::path::Path;
use std::process::Command;

fn require_jupyter_client() {
    let ok = Command::new("python3")
        .args(["-c", "import jupyter_client, nbclient, nbformat, zmq"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "python3 with jupyter_client, nbclient and nbformat is needed: run scripts/setup.sh"
    );
}

/// Runs `scenario`; its failures are check.py's assertion messages.
fn scenario(scenario: &str) {
    scenario_with(scenario, &[]);
}

/// Runs `scenario` with a kernel started with `flags` (in its kernelspec).
fn scenario_with(scenario: &str, flags: &[&str]) {
    scenario_in(scenario, flags, None);
}

/// [`scenario_with`], the kernel hosts' directory `hosts` (default: one of
/// the test's own).
fn scenario_in(scenario: &str, flags: &[&str], hosts: Option<&Path>) {
    require_jupyter_client();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/jupyter/check.py");
    // A private directory for the kernel hosts of this test (its sockets
    // are counted by the `host` scenario), short enough for a socket path.
    let own = std::env::temp_dir().join(format!(
        "rvisor-jupyter-test-{}-{}",
        std::process::id(),
        scenario
    ));
    let _ = std::fs::remove_dir_all(&own);
    let hosts = hosts.unwrap_or(&own);
    let out = Command::new("python3")
        .env("RVISOR_KERNEL_HOST_DIR", hosts)
        .arg(script)
        .arg(rvisor_bin())
        .arg(scenario)
        .args(flags)
        .output()
        .expect("python3 check.py starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&own);
    assert!(
        out.status.success() && stdout.contains(&format!("OK {scenario}")),
        "scenario {scenario} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    eprintln!("{stderr}");
}

/// kernel_info; state across cells; stdout and stderr streams; a warning;
/// an error with its traceback; a parse error; a plot as display_data;
/// store_history and silent; stop_on_error aborting the queued cell;
/// complete, is_complete, inspect, history, comm_info; every iopub message
/// of a request carries its header as parent.
#[test]
fn jupyter_client_basics() {
    scenario("basics");
}

/// `repeat {}` interrupted by an interrupt_request on control and by
/// SIGINT: the cell ends as interrupted and the next cell sees the earlier
/// variables.
#[test]
fn interrupt_keeps_state() {
    scenario("interrupt");
}

/// A restart gives a fresh session: earlier variables are gone and the
/// count starts again.
#[test]
fn restart_gives_a_fresh_session() {
    scenario("restart");
}

/// A worker that dies in a cell is reported, and the next cell says it ran
/// in a fresh session.
#[test]
fn a_crash_is_reported_and_the_next_cell_is_fresh() {
    scenario("crash");
}

/// A message signed with another key is not answered or run; signed ones
/// still are. A new iopub subscriber gets its `iopub_welcome`.
#[test]
fn a_bad_signature_is_refused() {
    scenario("bad_signature");
}

/// nbclient runs a small notebook: state, output, a plot, a data frame, a
/// warning, an error (allow_errors) and a cell after it with the state kept.
#[test]
fn nbclient_runs_a_notebook() {
    scenario("notebook");
}

/// nbclient runs a cell whose value is a DT widget: self-contained HTML,
/// in a kernel with the default confinement. (Debian's r-cran-jquerylib
/// runs `dpkg -s | grep | sed | cut` for jQuery's version, which the
/// default list of programs refuses; a confined worker reads the version
/// from the package's own files instead: driver_compat.R.)
#[test]
fn nbclient_shows_a_widget() {
    scenario("notebook_widget");
}

/// The stub listens on the kernel's ports before its host is up, and the
/// host serves a client that connected meanwhile and never reconnects.
#[test]
fn a_client_connecting_before_the_host_is_up_is_served() {
    scenario("early_ports");
}

/// A kernel's own messages reach the stderr of the stub its front end
/// started, not the kernel host's shared log.
#[test]
fn a_kernels_messages_go_to_its_stub_not_the_host_log() {
    scenario("kernel_messages");
}

/// `jupyter kernelspec list` shows the kernel `rvisor kernel install` wrote.
#[test]
fn kernelspec_list_shows_the_kernel() {
    scenario("kernelspec");
}

/// Visible values: the last one is the cell's execute_result (with its
/// execution_count), earlier ones display_data, each exactly as R prints
/// it; print() and cat() are streams; a data frame comes once, as a table
/// with its text; a failing print method leaves its partial text.
#[test]
fn values_are_execute_results() {
    scenario("values");
}

/// Displays are sent as they are made, in order with the stream text
/// (`cat("before"); head(mtcars); cat("after"); 1+1`: stream,
/// display_data, stream, execute_result; `print()` stays stream text, in
/// its place), plot pages at the end with the value last; a silent cell
/// sends nothing.
#[test]
fn displays_come_in_order_with_the_stream_text() {
    scenario("ordered");
}

/// `rvisor_display(x, display_id = "...")` is display_data with
/// `transient.display_id`; with `update = TRUE` it is update_display_data of
/// that id (in the same cell or a later one); bad arguments are errors.
#[test]
fn display_ids_are_sent_and_updated() {
    scenario("display_ids");
}

/// readline(), menu() and askYesNo() ask through input_request and get the
/// input_reply's value; with allow_stdin false they fail saying so; an
/// interrupt ends a cell waiting for input, with state kept, and a late
/// answer is not taken for the next question.
#[test]
fn input_requests_answer_readline_menu_and_askyesno() {
    scenario("input");
}

/// An input that is never answered does not stop the cell's timeout.
#[test]
fn a_pending_input_still_times_out() {
    scenario_with("input_timeout", &["--timeout", "2"]);
}

/// Kernels of one kernelspec share a kernel host, each with a session of
/// its own; a stub killed with SIGKILL ends its kernel alone; the host
/// exits when it has had no kernel for its idle time.
#[test]
fn kernels_share_a_host_and_a_killed_stub_ends_only_its_kernel() {
    scenario("host");
}

/// `--in-process`: the kernel with a supervisor of its own, as before the
/// host; a restart still gives a fresh session.
#[test]
fn an_in_process_kernel_restarts_fresh() {
    scenario_with("restart", &["--in-process"]);
}

/// Where no kernel host can be had (its directory is not a directory),
/// the kernel runs in its own process and works as ever.
#[test]
fn without_a_host_directory_the_kernel_runs_in_its_own_process() {
    let file = std::env::temp_dir().join(format!("rvisor-no-host-dir-{}", std::process::id()));
    std::fs::write(&file, "not a directory").unwrap();
    scenario_in("restart", &[], Some(&file));
    let _ = std::fs::remove_file(&file);
}

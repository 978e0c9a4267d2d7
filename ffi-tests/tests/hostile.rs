//! Hostile load against the real `rvisor serve`: bounded attacks on this
//! machine only (loopback), each checked by what the server holds or
//! answers. The figures they print are the ones the docs quote.

use rvisor_ffi_tests::{wait_for, ServeBin};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Uploads `rows` CSV rows generated on the fly (never whole in this
/// process either); returns the status and body of the answer.
fn upload_csv(addr: &str, rows: usize) -> (u16, String, bool) {
    const ROW: &str = "123456,some-name-0000000000,98765.4321,2024-01-02,TRUE\n";
    let header = "id,name,value,day,ok\n";
    let len = header.len() + ROW.len() * rows;
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST /v1/tables HTTP/1.1\r\nHost: x\r\nContent-Type: text/csv\r\n\
         Content-Length: {len}\r\nConnection: close\r\n\r\n{header}"
    )
    .expect("send the head");
    let chunk = ROW.repeat(4096);
    let mut left = rows;
    while left > 0 {
        let n = left.min(4096);
        if s.write_all(&chunk.as_bytes()[..n * ROW.len()]).is_err() {
            break; // answered early (and closed)
        }
        left -= n;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let retry = out.to_ascii_lowercase().contains("retry-after:");
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    (status, body, retry)
}

#[test]
fn concurrent_large_uploads_convert_in_bounded_memory() {
    let s = ServeBin::start(&[]);
    wait_for("the server to answer", Duration::from_secs(30), || {
        TcpStream::connect(&s.addr).ok()
    });
    let before = s.peak_rss();
    // Four 32 MiB CSV uploads at once: 128 MiB of bodies. A server that
    // held the bodies (let alone their converted batches) in memory would
    // pass the bound below.
    let rows = (32 << 20) / 56;
    let uploads: Vec<_> = (0..4)
        .map(|_| {
            let addr = s.addr.clone();
            std::thread::spawn(move || {
                // Busy (a turn not given within the wait): retry, as
                // Retry-After says.
                for _ in 0..5 {
                    let (status, body, retry) = upload_csv(&addr, rows);
                    if status == 503 && retry {
                        continue;
                    }
                    return (status, body);
                }
                (0, "still busy after 5 tries".to_string())
            })
        })
        .collect();
    for u in uploads {
        let (status, body) = u.join().expect("an upload thread");
        assert_eq!(status, 201, "{body}");
        assert!(body.contains(&format!("\"rows\":{rows}")), "{body}");
    }
    let peak = s.peak_rss();
    eprintln!(
        "hostile: 4 concurrent 32 MiB CSV uploads: server peak RSS {} MiB (before {} MiB)",
        peak >> 20,
        before >> 20
    );
    // Conversions run two at a time with 16k-row batches; bodies go to
    // disk as they arrive. 100 MiB leaves room for the runtime, the R-free
    // supervisor and the allocator, and is below the bodies alone.
    assert!(peak < 100 << 20, "peak RSS {} MiB", peak >> 20);
}

#[test]
fn an_upload_over_the_limit_is_refused_before_it_is_read() {
    let s = ServeBin::start(&[]);
    wait_for("the server to answer", Duration::from_secs(30), || {
        TcpStream::connect(&s.addr).ok()
    });
    // 300 MiB announced, over the 256 MiB upload limit: refused at once,
    // from the header, with nothing read.
    let mut c = TcpStream::connect(&s.addr).expect("connect");
    write!(
        c,
        "POST /v1/tables HTTP/1.1\r\nHost: x\r\nContent-Type: text/csv\r\n\
         Content-Length: {}\r\n\r\na,b\n",
        300u64 << 20
    )
    .expect("send the head");
    let mut out = String::new();
    let _ = c.read_to_string(&mut out);
    assert!(out.starts_with("HTTP/1.1 413"), "{out}");
    assert!(out.contains("too_large"), "{out}");
}

#[test]
fn a_body_that_trickles_in_is_refused_at_the_body_timeout() {
    let s = ServeBin::start(&["--body-timeout-secs", "1"]);
    for (path, ct) in [
        ("/v1/validate", "application/json"),
        ("/v1/sessions", "application/json"),
        ("/v1/tables", "text/csv"),
    ] {
        // 100 bytes announced, 5 sent, then nothing: the server answers
        // and closes instead of waiting for the rest.
        let mut c = TcpStream::connect(&s.addr).expect("connect");
        write!(
            c,
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ct}\r\nContent-Length: 100\r\n\r\n{{\"a\":"
        )
        .expect("send");
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut out = String::new();
        let _ = c.read_to_string(&mut out);
        assert!(out.starts_with("HTTP/1.1 400"), "{path}: {out}");
        assert!(
            out.contains("did not arrive") || out.contains("sent nothing"),
            "{path}: {out}"
        );
    }
}

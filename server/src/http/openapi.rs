//! The OpenAPI 3 document of the HTTP surface: generated from the types the
//! handlers use, then completed with what the annotations cannot say (the
//! error answers of every operation, security, the live request bounds,
//! media types and links).

use super::*;
/// The OpenAPI 3 document, generated from the types the handlers use. The
/// annotations give only the success answers: the error answers of every
/// operation are written by [`document`] from [`OPERATION_ERRORS`] and
/// `ErrorCode::http_status`, the one mapping.
#[derive(utoipa::OpenApi)]
#[openapi(
    info(
        title = "rvisor",
        description = "Run R code fast, safely and with state: the HTTP surface (see CONTRACT.md)."
    ),
    paths(
        health,
        packages::packages,
        packages::packages_install,
        packages::packages_lockfile,
        validate,
        run,
        create_session,
        session_run,
        session_status,
        session_cancel,
        session_reset,
        session_checkpoint,
        session_hibernate,
        session_restore,
        session_delete,
        files::files_list,
        files::file_put,
        files::file_get,
        files::file_delete,
        files::artifact_get,
        table_create,
        table_get,
        table_delete,
        openapi,
        metrics,
        usage,
        livez,
        readyz,
        admin_drain,
        history::sessions_list,
        history::session_history,
        history::admin_stats,
        watch::session_watch
    ),
    components(schemas(ErrorBody, ErrorDetail))
)]
struct ApiDoc;

/// The error codes each operation (method, path as the document writes it)
/// can answer, besides `unauthorized`, which every route not in
/// [`UNAUTHENTICATED`] answers without a valid token when the server has
/// tokens. The document's error responses are written from this table
/// with `ErrorCode::http_status`, so a status is documented exactly when
/// one of the operation's codes maps to it.
/// Where the codes come from: a JSON body (`ApiJson`): `bad_request`,
/// `too_large`, `invalid`; a path parameter (`ApiPath`): `bad_request`;
/// `blocking`: `internal`; finding a session ([`SESSION_LOOKUP`]); the
/// rest from the [`Service`] call. (A connection over the connection caps
/// is answered 503 `busy` before any request is read, by no operation:
/// docs/http.md, "Connections".)
pub const OPERATION_ERRORS: &[(&str, &str, &[ErrorCode])] = {
    use ErrorCode as E;
    &[
        ("get", "/v1/health", &[E::Internal]),
        ("get", "/v1/packages", &[E::NoWorker, E::Internal]),
        ("get", "/v1/packages/lockfile", &[E::NotFound, E::Internal]),
        (
            "post",
            "/v1/packages/install",
            &[
                E::BadRequest,
                E::NotFound,
                E::TooLarge,
                E::Invalid,
                E::Package,
                E::Internal,
            ],
        ),
        (
            "post",
            "/v1/validate",
            &[E::BadRequest, E::TooLarge, E::Invalid, E::Internal],
        ),
        // No 429: one-shot runs are not counted against a tenant's call
        // cap (`AdmissionConfig::max_calls_per_tenant` counts session
        // calls), and have no queue.
        (
            "post",
            "/v1/run",
            &[
                E::BadRequest,
                E::TooLarge,
                E::Invalid,
                E::DataPointerUnresolved,
                E::Conflict,
                E::FileRefused,
                E::NoWorker,
                E::Draining,
                E::Internal,
            ],
        ),
        (
            "post",
            "/v1/sessions",
            &[
                E::BadRequest,
                E::TooLarge,
                E::Invalid,
                E::Quota,
                E::NoWorker,
                E::Draining,
                E::Storage,
                E::Internal,
            ],
        ),
        (
            "post",
            "/v1/sessions/{id}/run",
            &[
                E::BadRequest,
                E::NotFound,
                E::TooLarge,
                E::Invalid,
                E::QueueFull,
                E::Quota,
                E::Busy,
                E::NoWorker,
                E::Draining,
                E::Storage,
                E::Internal,
            ],
        ),
        ("get", "/v1/sessions/{id}", SESSION_LOOKUP),
        ("post", "/v1/sessions/{id}/cancel", SESSION_LOOKUP),
        ("post", "/v1/sessions/{id}/reset", SESSION_LOOKUP),
        (
            "post",
            "/v1/sessions/{id}/checkpoint",
            &[
                E::BadRequest,
                E::NotFound,
                E::Closed,
                E::Conflict,
                E::TooLarge,
                E::Invalid,
                E::Quota,
                E::Busy,
                E::NoWorker,
                E::Draining,
                E::Storage,
                E::Internal,
            ],
        ),
        ("post", "/v1/sessions/{id}/hibernate", SESSION_LOOKUP),
        (
            "post",
            "/v1/sessions/{id}/restore",
            &[
                E::BadRequest,
                E::NotFound,
                E::Closed,
                E::Conflict,
                E::Invalid,
                E::Busy,
                E::NoWorker,
                E::Draining,
                E::Storage,
                E::Internal,
            ],
        ),
        ("delete", "/v1/sessions/{id}", SESSION_LOOKUP),
        (
            "post",
            "/v1/tables",
            &[
                E::BadRequest,
                E::TooLarge,
                E::Invalid,
                E::Quota,
                E::Busy,
                E::Storage,
                E::Internal,
            ],
        ),
        ("get", "/v1/sessions/{id}/files", FILE_READ),
        (
            "put",
            "/v1/sessions/{id}/files/{path}",
            &[
                E::BadRequest,
                E::NotFound,
                E::FileRefused,
                E::TooLarge,
                E::Quota,
                E::Invalid,
                E::Busy,
                E::NoWorker,
                E::Draining,
                E::Storage,
                E::Internal,
            ],
        ),
        ("get", "/v1/sessions/{id}/files/{path}", FILE_DOWNLOAD),
        (
            "get",
            "/v1/artifacts/{execution_id}/{name}",
            &[
                E::BadRequest,
                E::NotFound,
                E::RangeNotSatisfiable,
                E::Storage,
                E::Internal,
            ],
        ),
        ("delete", "/v1/sessions/{id}/files/{path}", FILE_READ),
        ("get", "/v1/tables/{pointer}", &[E::BadRequest, E::NotFound]),
        (
            "delete",
            "/v1/tables/{pointer}",
            &[E::BadRequest, E::NotFound],
        ),
        ("get", "/v1/openapi.json", &[]),
        ("get", "/metrics", &[E::Forbidden]),
        ("get", "/v1/usage", &[]),
        ("get", "/livez", &[]),
        ("get", "/readyz", &[E::Internal]),
        ("post", "/v1/admin/drain", &[E::Forbidden]),
        ("get", "/v1/sessions", &[E::Internal]),
        ("get", "/v1/sessions/{id}/history", SESSION_LOOKUP),
        ("get", "/v1/sessions/{id}/watch", SESSION_LOOKUP),
        ("get", "/v1/admin/stats", &[E::Forbidden, E::Internal]),
    ]
};

/// The codes of an operation on one session by id (`ApiPath`, then
/// `Service::session`): `bad_request` for an id that is not UTF-8,
/// `not_found`; with a store, a session this node does not hold is taken
/// over from it (`Service::adopt`): `storage` when the store fails, `busy`
/// while another node holds it, `draining` on a draining node, and its
/// resumption with the stored options: `invalid` (options this server's
/// rules no longer allow), `no_worker`, `internal`.
pub const SESSION_LOOKUP: &[ErrorCode] = {
    use ErrorCode as E;
    &[
        E::BadRequest,
        E::NotFound,
        E::Invalid,
        E::Busy,
        E::NoWorker,
        E::Draining,
        E::Storage,
        E::Internal,
    ]
};

/// The codes of reading a session's files: the session's lookup, then
/// `file_refused` (a name or kind rule), `too_large` (a file over
/// `max_file_bytes`), `quota` (more files than `max_files`).
pub const FILE_READ: &[ErrorCode] = {
    use ErrorCode as E;
    &[
        E::BadRequest,
        E::NotFound,
        E::FileRefused,
        E::TooLarge,
        E::Quota,
        E::Invalid,
        E::Busy,
        E::NoWorker,
        E::Draining,
        E::Storage,
        E::Internal,
    ]
};

/// The codes of downloading a session's file: those of reading it, and
/// `range_not_satisfiable` (a `Range` outside the file).
pub const FILE_DOWNLOAD: &[ErrorCode] = {
    use ErrorCode as E;
    &[
        E::BadRequest,
        E::NotFound,
        E::FileRefused,
        E::TooLarge,
        E::RangeNotSatisfiable,
        E::Quota,
        E::Invalid,
        E::Busy,
        E::NoWorker,
        E::Draining,
        E::Storage,
        E::Internal,
    ]
};

/// Paths answered without a token: the orchestrators' probes, and this
/// document (it holds no secrets, and a client generator must be able to
/// fetch it before it has a token). The auth layer lets a request through
/// by this table (the path its route matched), and [`document`] writes
/// the operations' `security` from it (none here; the bearer scheme on
/// every other operation of a server with tokens), so the two cannot
/// drift.
pub const UNAUTHENTICATED: &[&str] = &["/livez", "/readyz", "/v1/openapi.json"];

/// The operations only a server that keeps checkpoints (`--state-dir`, or
/// a store) offers: the document of one that keeps none leaves them out,
/// and they answer it 404 `not_found` saying how to turn them on.
pub const CHECKPOINT_OPERATIONS: &[(&str, &str)] = &[
    ("post", "/v1/sessions/{id}/checkpoint"),
    ("post", "/v1/sessions/{id}/hibernate"),
    ("post", "/v1/sessions/{id}/restore"),
];

/// The OpenAPI document of a server: the generated one, with each
/// operation's error responses (from [`OPERATION_ERRORS`]; 401 when
/// `auth`, on every operation but those of [`UNAUTHENTICATED`]), who may
/// call each operation (its `security`: the bearer scheme on those same
/// operations when `auth`, nothing otherwise), and the bounds the server
/// checks requests against (its `rules` and confinement `limits`, `None`
/// when unconfined) written into the request schemas, so that the schema
/// accepts what the decoder and the checks accept. Without `checkpoints`
/// the [`CHECKPOINT_OPERATIONS`] are left out: the server does not offer
/// them.
pub fn document(
    auth: bool,
    rules: &rvisor::SafetyRules,
    limits: Option<&rvisor::Limits>,
    checkpoints: bool,
) -> serde_json::Value {
    use utoipa::OpenApi;
    let mut doc = serde_json::to_value(ApiDoc::openapi()).unwrap_or_default();
    error_responses(&mut doc, auth);
    security(&mut doc, auth);
    request_bounds(&mut doc, rules, limits);
    media_types(&mut doc);
    if !checkpoints {
        if let Some(paths) = doc
            .get_mut("paths")
            .and_then(serde_json::Value::as_object_mut)
        {
            for (_, path) in CHECKPOINT_OPERATIONS {
                paths.remove(*path);
            }
        }
    }
    links(&mut doc, checkpoints);
    doc
}

/// The document of the server `service` is (its auth, rules, limits and
/// whether it keeps checkpoints).
pub fn service_document(service: &Service) -> serde_json::Value {
    let sup = service.supervisor();
    let limits = sup.config().worker.confine.as_ref().map(|c| &c.limits);
    document(
        service.requires_auth(),
        service.rules(),
        limits,
        service.keeps_checkpoints(),
    )
}

/// The document of a server with tokens, the default rules and limits,
/// and checkpoints (every operation).
pub fn openapi_json() -> String {
    let doc = document(
        true,
        &rvisor::SafetyRules::default(),
        Some(&rvisor::Limits::default()),
        true,
    );
    serde_json::to_string_pretty(&doc).unwrap_or_default()
}

/// The operation object at `path`, `method` of `doc`.
fn operation<'a>(
    doc: &'a mut serde_json::Value,
    method: &str,
    path: &str,
) -> Option<&'a mut serde_json::Map<String, serde_json::Value>> {
    doc.get_mut("paths")?
        .get_mut(path)?
        .get_mut(method)?
        .as_object_mut()
}

fn error_responses(doc: &mut serde_json::Value, auth: bool) {
    for (method, path, codes) in OPERATION_ERRORS {
        let Some(responses) = operation(doc, method, path)
            .and_then(|op| op.get_mut("responses"))
            .and_then(serde_json::Value::as_object_mut)
        else {
            continue;
        };
        let mut by_status: std::collections::BTreeMap<u16, Vec<String>> = Default::default();
        let open = UNAUTHENTICATED.contains(path);
        let auth_code = (auth && !open).then_some(ErrorCode::Unauthorized);
        for c in codes.iter().copied().chain(auth_code) {
            by_status
                .entry(c.http_status())
                .or_default()
                .push(format!("`{c}`"));
        }
        for (status, names) in by_status {
            responses.insert(
                status.to_string(),
                json!({
                    "description": format!("Error {}: `{{\"error\": {{\"code\", \"message\"}}}}`", names.join(", ")),
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
                }),
            );
        }
    }
    let codes: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
    if let Some(code) = doc.pointer_mut("/components/schemas/ErrorDetail/properties/code") {
        code["enum"] = json!(codes);
    }
}

/// Who may call each operation, said where generators read it: on the
/// operation (openapi-python-client, for one, reads no top-level
/// `security`; an operation with none is anonymous to it). With tokens,
/// every operation but those of [`UNAUTHENTICATED`] requires the bearer
/// scheme (and documents 401); those require nothing (`security: []`),
/// as the auth layer lets them through by the same table. Without
/// tokens nothing requires a token and no scheme is declared.
fn security(doc: &mut serde_json::Value, auth: bool) {
    let bearer = json!([{"bearer": []}]);
    if let Some(d) = doc.as_object_mut() {
        if auth {
            d.insert("security".into(), bearer.clone());
        } else {
            d.remove("security");
        }
    }
    if let Some(c) = doc
        .pointer_mut("/components")
        .and_then(serde_json::Value::as_object_mut)
    {
        if auth {
            c.insert(
                "securitySchemes".into(),
                json!({"bearer": {"type": "http", "scheme": "bearer", "description": "A token of the server's token file (`rvisor serve --tokens FILE`), as `Authorization: Bearer <token>`. Without a valid one every operation that requires it answers 401 `unauthorized`."}}),
            );
        } else {
            c.remove("securitySchemes");
        }
    }
    let Some(paths) = doc
        .get_mut("paths")
        .and_then(serde_json::Value::as_object_mut)
    else {
        return;
    };
    for (path, item) in paths.iter_mut() {
        let Some(item) = item.as_object_mut() else {
            continue;
        };
        let needs_token = auth && !UNAUTHENTICATED.contains(&path.as_str());
        for (method, op) in item.iter_mut() {
            if !OPERATION_METHODS.contains(&method.as_str()) {
                continue;
            }
            if let Some(op) = op.as_object_mut() {
                let s = if needs_token {
                    bearer.clone()
                } else {
                    json!([])
                };
                op.insert("security".into(), s);
            }
        }
    }
}

/// The keys of a path item that are operations (OpenAPI 3.1).
const OPERATION_METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// Merges `extra` into the schema of property `prop` of component `schema`.
fn narrow(doc: &mut serde_json::Value, schema: &str, prop: &str, extra: serde_json::Value) {
    let target = doc
        .get_mut("components")
        .and_then(|c| c.get_mut("schemas"))
        .and_then(|s| s.get_mut(schema))
        .and_then(|s| s.get_mut("properties"))
        .and_then(|p| p.get_mut(prop))
        .and_then(serde_json::Value::as_object_mut);
    if let (Some(t), serde_json::Value::Object(extra)) = (target, extra) {
        t.extend(extra);
    }
}

/// A syntactic R name, as `rvisor::ops::syntactic_name` checks it.
fn r_name_schema() -> serde_json::Value {
    json!({
        "type": "string",
        "description": "A syntactic R name (letters, digits, `.` and `_`; starts with a letter or a `.` not followed by a digit; not a reserved word; at most 10000 bytes, R's limit)",
        "maxLength": rvisor::ops::MAX_NAME_BYTES,
        "pattern": r"^([A-Za-z][A-Za-z0-9._]*|\.([A-Za-z._][A-Za-z0-9._]*)?)$",
        "not": {"anyOf": [
            {"enum": ["if", "else", "repeat", "while", "function", "for", "next", "break", "TRUE", "FALSE", "NULL", "Inf", "NaN", "NA", "NA_integer_", "NA_real_", "NA_character_", "NA_complex_", "in", "..."]},
            {"pattern": r"^\.\.[0-9]*$"}
        ]}
    })
}

fn request_bounds(
    doc: &mut serde_json::Value,
    rules: &rvisor::SafetyRules,
    limits: Option<&rvisor::Limits>,
) {
    let t = &rules.timeout_seconds;
    for s in ["RunScript", "NewSession", "SessionRun"] {
        narrow(
            doc,
            s,
            "timeout_seconds",
            json!({"minimum": t.min, "maximum": t.max}),
        );
    }
    for s in ["NewSession", "SessionRun"] {
        for p in ["plot_width", "plot_height"] {
            narrow(
                doc,
                s,
                p,
                json!({"minimum": 1, "maximum": rvisor::MAX_PLOT_SIDE}),
            );
        }
    }
    // `DisplayOptions::problem` refuses limits out of these ranges.
    for p in ["max_rows", "max_cols"] {
        narrow(
            doc,
            "DisplayOptions",
            p,
            json!({"minimum": 1, "maximum": rvisor_protocol::display::MAX_TABLE_SIDE}),
        );
    }
    narrow(
        doc,
        "DisplayOptions",
        "html_max_bytes",
        json!({"minimum": 1, "maximum": rvisor_protocol::display::MAX_HTML_MAX_BYTES}),
    );
    // `Session::run` refuses blank code and code over the size limit.
    narrow(
        doc,
        "SessionRun",
        "code",
        json!({"minLength": 1, "maxLength": rvisor::MAX_CODE_BYTES, "pattern": r"\S"}),
    );
    narrow(
        doc,
        "RunScript",
        "variables",
        json!({"maxItems": rules.max_variables}),
    );
    narrow(
        doc,
        "RunScript",
        "dataframes",
        json!({"maxItems": rules.max_dataframes}),
    );
    narrow(doc, "Variable", "name", r_name_schema());
    narrow(doc, "DataframeRef", "name", r_name_schema());
    let scalar = [
        json!({"type": "number"}),
        json!({"type": "string"}),
        json!({"type": "boolean"}),
    ];
    let arrays = scalar.iter().map(|s| json!({"type": "array", "items": s}));
    let any: Vec<serde_json::Value> = scalar.iter().cloned().chain(arrays).collect();
    narrow(doc, "Variable", "value", json!({"anyOf": any}));
    match limits {
        // Limits can only tighten the server's, and R needs 512 MiB.
        Some(l) => {
            let mut cpu = json!({"minimum": 1});
            if let Some(max) = l.cpu_seconds {
                cpu["maximum"] = json!(max);
            }
            for (p, v) in [
                (
                    "memory_mb",
                    json!({"minimum": 512, "maximum": l.memory_bytes >> 20}),
                ),
                (
                    "disk_mb",
                    json!({"minimum": 1, "maximum": l.disk_bytes >> 20}),
                ),
                ("processes", json!({"minimum": 1, "maximum": l.processes})),
                ("cpu_seconds", cpu),
            ] {
                narrow(doc, "LimitsRequest", p, v);
            }
        }
        // An unconfined server refuses every limit.
        None => {
            for s in ["RunScript", "NewSession"] {
                narrow(
                    doc,
                    s,
                    "limits",
                    json!({"oneOf": [{"type": "null"}], "description": "This server runs unconfined: limits are refused."}),
                );
            }
        }
    }
}

/// What the annotations cannot say: a table upload's three formats, the
/// form of path parameters, the HTML rendering of results.
fn media_types(doc: &mut serde_json::Value) {
    if let Some(body) =
        operation(doc, "post", "/v1/tables").and_then(|op| op.get_mut("requestBody"))
    {
        // A CSV upload is a file's bytes (as the Arrow stream is): what
        // makes them a table (UTF-8, a header, rows of its length) is the
        // parser's to say, beyond JSON Schema; what it cannot read is 422.
        body["content"] = json!({
            "text/csv": {"schema": {"type": "string", "format": "binary", "description": "The bytes of a CSV file: UTF-8, a header line, then rows with as many fields (NA or empty: missing). Content the CSV reader cannot read is refused with 422 `invalid`, saying why"}},
            "application/json": {"schema": {"type": "array", "minItems": 1, "items": {
                "type": "object", "minProperties": 1,
                "additionalProperties": {"type": ["string", "number", "boolean", "null"]}
            }}},
            "application/vnd.apache.arrow.stream": {"schema": {"type": "string", "format": "binary", "description": "An Arrow IPC stream. A stream that cannot be read is refused with 422 `invalid`, saying why"}}
        });
    }
    // A file's bytes, either way: any content (its type says nothing the
    // server checks); downloads carry the file's own media type.
    if let Some(body) = operation(doc, "put", "/v1/sessions/{id}/files/{path}")
        .and_then(|op| op.get_mut("requestBody"))
    {
        body["content"] = json!({"application/octet-stream": {"schema": {"type": "string", "format": "binary", "description": "The file's bytes (streamed to the file as they arrive; any Content-Type)"}}});
        // No body is an empty file.
        body["required"] = json!(false);
    }
    for path in [
        "/v1/sessions/{id}/files/{path}",
        "/v1/artifacts/{execution_id}/{name}",
    ] {
        if let Some(ok) = operation(doc, "get", path).and_then(|op| op.get_mut("responses")) {
            ok["200"]["content"] = json!({"application/octet-stream": {"schema": {"type": "string", "format": "binary", "description": "The file's bytes; Content-Type is its media type (from its extension), Content-Length its size"}}});
        }
    }
    if let Some(ok) =
        operation(doc, "get", "/v1/sessions/{id}/watch").and_then(|op| op.get_mut("responses"))
    {
        // The schema of one event (as Server-Sent Events clients and
        // schemathesis read them: its fields), not of the whole body.
        ok["200"]["content"] = json!({"text/event-stream": {"schema": {
            "type": "object",
            "description": "One Server-Sent Event: `watching` first (data {session_id}), then per call `call` (data {execution_id, code}) and its events as a streaming run gives them (`id` the event's seq, `data` its JSON), ending with `result` (the RunResult). The stream runs until the session closes; closing it never cancels a call",
            "properties": {
                "event": {"type": "string"},
                "data": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer"}
            }
        }}});
    }
    for path in ["/v1/run", "/v1/sessions/{id}/run"] {
        if let Some(ok) = operation(doc, "post", path).and_then(|op| op.get_mut("responses")) {
            ok["200"]["content"]["text/html"] = json!({"schema": {"type": "string", "description": "A self-contained HTML fragment"}});
            ok["200"]["content"]["text/event-stream"] = json!({"schema": {"type": "string", "description": "Server-Sent Events while the call runs: `id` is the event's seq, `event` its kind (stdout, stderr, message, warning, error, plot, display (with `index` and, when it was small enough to stream, its MIME bundle in `display`, as the result's displays[index]), progress; `lagged` in place of events a client read too slowly to be sent: events first_seq..seq, holding `bytes` bytes of text, all of it in the result), `data` the event's JSON ({execution_id, seq, kind, ...}); the last event, named `result`, carries the RunResult. Closing the stream cancels the call"}});
            ok["200"]["content"]["application/x-ndjson"] = json!({"schema": {"type": "string", "description": "One event per line while the call runs ({execution_id, seq, kind, ...}; kind `display` has `index` and, when it was small enough to stream, its MIME bundle in `display`; kind `lagged` in place of events a client read too slowly to be sent); the last line has kind `result` and the RunResult in `result`. Closing the stream cancels the call"}});
        }
    }
    if let Some(paths) = doc
        .get_mut("paths")
        .and_then(serde_json::Value::as_object_mut)
    {
        for item in paths.values_mut() {
            let Some(item) = item.as_object_mut() else {
                continue;
            };
            for op in item.values_mut() {
                let Some(params) = op
                    .get_mut("parameters")
                    .and_then(serde_json::Value::as_array_mut)
                else {
                    continue;
                };
                // Ids and pointers the server hands out are of these
                // characters; `.` or `..` would not even reach the route.
                for p in params.iter_mut().filter(|p| p["in"] == "path") {
                    if p["name"] == "path" || p["name"] == "name" {
                        // A file's path: any non-empty string; the rules
                        // of rvisor::file_rules (no `..`, NFC...) are
                        // beyond a pattern and answer 409 `file_refused`.
                        p["schema"]["minLength"] = json!(1);
                    } else {
                        p["schema"]["pattern"] = json!("^[A-Za-z0-9_-]+$");
                    }
                }
            }
        }
    }
}

/// How ids flow between operations (OpenAPI links): a new session's `id`
/// addresses the session routes (the checkpoint ones when the server has
/// them), a stored table's `data_pointer` the table routes. (A one-shot
/// run's `session.id` addresses nothing.)
fn links(doc: &mut serde_json::Value, checkpoints: bool) {
    let mut session_ops = vec![
        ("status", "session_status"),
        ("run", "session_run"),
        ("cancel", "session_cancel"),
        ("reset", "session_reset"),
        ("close", "session_delete"),
    ];
    if checkpoints {
        session_ops.extend([
            ("checkpoint", "session_checkpoint"),
            ("hibernate", "session_hibernate"),
            ("restore", "session_restore"),
        ]);
    }
    let table_ops = [("get", "table_get"), ("delete", "table_delete")];
    for (path, status, param, field, ops) in [
        ("/v1/sessions", "201", "id", "id", &session_ops[..]),
        (
            "/v1/tables",
            "201",
            "pointer",
            "data_pointer",
            &table_ops[..],
        ),
    ] {
        let mut l = serde_json::Map::new();
        for (name, op) in ops {
            l.insert(
                (*name).to_string(),
                json!({"operationId": op, "parameters": {param: format!("$response.body#/{field}")}}),
            );
        }
        let created = operation(doc, "post", path)
            .and_then(|op| op.get_mut("responses"))
            .and_then(|r| r.get_mut(status))
            .and_then(serde_json::Value::as_object_mut);
        if let Some(created) = created {
            created.insert("links".into(), serde_json::Value::Object(l));
        }
    }
}

#[cfg(test)]
mod openapi_tests {
    use super::*;
    use std::collections::BTreeSet;

    const METHODS: [&str; 5] = ["get", "post", "put", "patch", "delete"];

    fn operations(doc: &serde_json::Value) -> BTreeSet<(String, String)> {
        let mut out = BTreeSet::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for m in METHODS {
                if item.get(m).is_some() {
                    out.insert((m.to_string(), path.clone()));
                }
            }
        }
        out
    }

    fn default_doc(auth: bool) -> serde_json::Value {
        document(
            auth,
            &rvisor::SafetyRules::default(),
            Some(&rvisor::Limits::default()),
            true,
        )
    }

    #[test]
    fn a_server_without_checkpoints_documents_no_checkpoint_operations() {
        let all = operations(&default_doc(true));
        let doc = document(
            true,
            &rvisor::SafetyRules::default(),
            Some(&rvisor::Limits::default()),
            false,
        );
        let offered = operations(&doc);
        let gone: BTreeSet<(String, String)> = CHECKPOINT_OPERATIONS
            .iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect();
        assert_eq!(gone.len(), 3);
        assert_eq!(
            all.difference(&offered).cloned().collect::<BTreeSet<_>>(),
            gone
        );
        // No link points to an operation that is not there.
        let links = &doc["paths"]["/v1/sessions"]["post"]["responses"]["201"]["links"];
        for (name, link) in links.as_object().expect("links") {
            let op = link["operationId"].as_str().unwrap_or("");
            assert!(
                !op.contains("checkpoint") && !op.contains("restore") && !op.contains("hibernate"),
                "{name}"
            );
        }
        let with = &default_doc(true)["paths"]["/v1/sessions"]["post"]["responses"]["201"]["links"];
        assert_eq!(with["restore"]["operationId"], "session_restore");
    }

    #[test]
    fn every_operation_has_one_entry_in_the_error_table() {
        let doc = default_doc(true);
        let documented = operations(&doc);
        let table: BTreeSet<(String, String)> = OPERATION_ERRORS
            .iter()
            .map(|(m, p, _)| (m.to_string(), p.to_string()))
            .collect();
        assert_eq!(table.len(), OPERATION_ERRORS.len(), "an operation twice");
        assert_eq!(documented, table);
        // The routes of CONTRACT.md are all there.
        for p in [
            "/v1/health",
            "/v1/packages",
            "/v1/validate",
            "/v1/run",
            "/v1/tables",
            "/v1/tables/{pointer}",
            "/v1/sessions",
            "/v1/sessions/{id}",
            "/v1/sessions/{id}/run",
            "/v1/sessions/{id}/cancel",
            "/v1/openapi.json",
            "/metrics",
        ] {
            assert!(doc["paths"].get(p).is_some(), "{p}");
        }
    }

    #[test]
    fn the_error_statuses_are_exactly_those_of_the_codes() {
        for auth in [true, false] {
            let doc = default_doc(auth);
            for (m, p, codes) in OPERATION_ERRORS {
                let responses = doc["paths"][p][m]["responses"]
                    .as_object()
                    .expect("responses");
                let errors: BTreeSet<u16> = responses
                    .keys()
                    .filter_map(|k| k.parse::<u16>().ok())
                    .filter(|s| *s >= 400)
                    .collect();
                let mut want: BTreeSet<u16> = codes.iter().map(|c| c.http_status()).collect();
                if auth && !UNAUTHENTICATED.contains(p) {
                    want.insert(401);
                }
                let mut errors = errors;
                if *p == "/readyz" {
                    // Not ready is an answer of its own shape, not an error.
                    assert!(errors.remove(&503), "/readyz documents its 503");
                }
                assert_eq!(errors, want, "{m} {p} (auth {auth})");
                for s in errors {
                    let r = &responses[&s.to_string()];
                    assert_eq!(
                        r["content"]["application/json"]["schema"]["$ref"],
                        "#/components/schemas/ErrorBody",
                        "{m} {p} {s}"
                    );
                    // The description names the codes behind the status.
                    for c in codes.iter().filter(|c| c.http_status() == s) {
                        let d = r["description"].as_str().unwrap_or("");
                        assert!(d.contains(c.as_str()), "{m} {p} {s}: {d}");
                    }
                }
                let ok = responses.keys().any(|k| k.starts_with('2'));
                assert!(ok, "{m} {p} has no success answer");
            }
        }
    }

    #[test]
    fn the_bearer_scheme_is_declared_and_required_only_with_tokens() {
        let doc = default_doc(true);
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["type"],
            "http"
        );
        assert_eq!(
            doc["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        assert_eq!(doc["security"], json!([{"bearer": []}]));
        let open = default_doc(false);
        assert!(open.get("security").is_none());
        assert!(open["components"].get("securitySchemes").is_none());
        // Nothing of a server without tokens requires one.
        for (m, p) in operations(&open) {
            assert_eq!(open["paths"][&p][&m]["security"], json!([]), "{m} {p}");
        }
    }

    /// Generators read `security` on the operation (an operation without
    /// one is anonymous to openapi-python-client): with tokens every
    /// operation says whether it needs one, as the auth layer decides it
    /// (`UNAUTHENTICATED`), and those that need one document 401.
    #[test]
    fn every_operation_says_whether_it_needs_the_token() {
        let doc = default_doc(true);
        let ops = operations(&doc);
        assert_eq!(ops.len(), OPERATION_ERRORS.len());
        for (m, p) in &ops {
            let op = &doc["paths"][p][m];
            let open = UNAUTHENTICATED.contains(&p.as_str());
            let want = if open {
                json!([])
            } else {
                json!([{"bearer": []}])
            };
            assert_eq!(op["security"], want, "{m} {p}");
            assert_eq!(op["responses"].get("401").is_some(), !open, "{m} {p}");
            if !open {
                let d = op["responses"]["401"]["description"].as_str().unwrap_or("");
                assert!(d.contains("`unauthorized`"), "{m} {p}: {d}");
            }
        }
        // The probes and the document itself answer anyone; everything
        // a client does with R needs the token.
        for p in ["/livez", "/readyz", "/v1/openapi.json"] {
            assert_eq!(doc["paths"][p]["get"]["security"], json!([]), "{p}");
        }
        for (m, p) in [
            ("get", "/v1/health"),
            ("post", "/v1/validate"),
            ("post", "/v1/run"),
            ("post", "/v1/sessions"),
            ("post", "/v1/sessions/{id}/run"),
            ("delete", "/v1/sessions/{id}"),
            ("post", "/v1/tables"),
            ("get", "/metrics"),
        ] {
            assert_eq!(
                doc["paths"][p][m]["security"],
                json!([{"bearer": []}]),
                "{m} {p}"
            );
        }
    }

    /// 429 is documented exactly where a quota or a queue can refuse:
    /// new sessions (session caps), session calls (queue, call cap,
    /// admission), table uploads (table quotas) and checkpoints (the
    /// checkpoint quota), with the error body.
    #[test]
    fn too_many_requests_is_documented_where_it_can_happen() {
        let doc = default_doc(true);
        let with_429: BTreeSet<(String, String)> = operations(&doc)
            .into_iter()
            .filter(|(m, p)| doc["paths"][p][m]["responses"].get("429").is_some())
            .collect();
        let want: BTreeSet<(String, String)> = [
            ("post", "/v1/sessions"),
            ("post", "/v1/sessions/{id}/run"),
            ("post", "/v1/sessions/{id}/checkpoint"),
            ("get", "/v1/sessions/{id}/files"),
            ("put", "/v1/sessions/{id}/files/{path}"),
            ("get", "/v1/sessions/{id}/files/{path}"),
            ("delete", "/v1/sessions/{id}/files/{path}"),
            ("post", "/v1/tables"),
        ]
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
        assert_eq!(with_429, want);
        let run = &doc["paths"]["/v1/sessions/{id}/run"]["post"]["responses"]["429"];
        assert_eq!(
            run["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/ErrorBody"
        );
        let d = run["description"].as_str().unwrap_or("");
        assert!(d.contains("`queue_full`") && d.contains("`quota`"), "{d}");
    }

    #[test]
    fn error_codes_in_the_schema_are_the_service_codes() {
        let doc = default_doc(true);
        let codes = doc["components"]["schemas"]["ErrorDetail"]["properties"]["code"]["enum"]
            .as_array()
            .expect("an enum of codes")
            .len();
        assert_eq!(codes, ErrorCode::ALL.len());
    }

    #[test]
    fn request_bounds_follow_the_rules_and_limits() {
        let mut rules = rvisor::SafetyRules::default();
        rules.timeout_seconds.max = 42;
        let doc = document(true, &rules, Some(&rvisor::Limits::default()), true);
        let s = &doc["components"]["schemas"];
        assert_eq!(
            s["RunScript"]["properties"]["timeout_seconds"]["maximum"],
            42
        );
        assert_eq!(
            s["RunScript"]["properties"]["variables"]["maxItems"],
            rules.max_variables
        );
        assert_eq!(
            s["LimitsRequest"]["properties"]["memory_mb"]["maximum"],
            rvisor::Limits::default().memory_bytes >> 20
        );
        let unconfined = document(true, &rules, None, true);
        assert_eq!(
            unconfined["components"]["schemas"]["NewSession"]["properties"]["limits"]["oneOf"],
            json!([{"type": "null"}])
        );
    }

    #[test]
    fn displays_and_their_options_are_in_the_document() {
        let doc = document(true, &rvisor::SafetyRules::default(), None, true);
        let s = &doc["components"]["schemas"];
        assert!(
            s["RunResult"]["properties"]["displays"].is_object(),
            "{}",
            s["RunResult"]
        );
        assert!(s["Display"]["properties"]["data"].is_object());
        assert!(s["Display"]["properties"]["metadata"].is_object());
        for req in ["RunScript", "NewSession", "SessionRun"] {
            assert!(s[req]["properties"]["display"].is_object(), "{req}");
        }
        assert_eq!(s["DisplayOptions"]["properties"]["max_rows"]["minimum"], 1);
        assert_eq!(
            s["DisplayOptions"]["properties"]["max_cols"]["maximum"],
            rvisor_protocol::display::MAX_TABLE_SIDE
        );
        let segment = s["Segment"].to_string();
        assert!(segment.contains("\"display\""), "{segment}");
    }

    #[test]
    fn the_r_name_pattern_agrees_with_the_check() {
        let schema = r_name_schema();
        let pattern = regex::Regex::new(schema["pattern"].as_str().unwrap()).unwrap();
        let not_pattern =
            regex::Regex::new(schema["not"]["anyOf"][1]["pattern"].as_str().unwrap()).unwrap();
        let reserved = schema["not"]["anyOf"][0]["enum"].as_array().unwrap();
        let accepts = |n: &str| {
            pattern.is_match(n) && !not_pattern.is_match(n) && !reserved.iter().any(|r| r == n)
        };
        for n in [
            "x", "x1", "x.y", "x_y", ".x", ".", "..x", "._", "if", "TRUE", "in", "...", "..",
            "..1", ".1", "1x", "_x", "", "x-y", "é", "a b", "NA_real_", "Inf2",
        ] {
            assert_eq!(accepts(n), rvisor::ops::syntactic_name(n), "{n:?}");
        }
    }

    #[test]
    fn whole_numbers_may_be_written_with_a_fraction_of_zero() {
        let s: NewSession =
            serde_json::from_str(r#"{"plot_width": 640.0, "limits": {"memory_mb": 1024.0}}"#)
                .unwrap();
        assert_eq!(s.plot_width, Some(640));
        assert_eq!(s.limits.and_then(|l| l.memory_mb), Some(1024));
        for bad in [
            r#"{"plot_width": 640.5}"#,
            r#"{"plot_width": -1}"#,
            r#"{"plot_width": 4294967296}"#,
            r#"{"plot_width": "640"}"#,
            r#"{"limits": {"processes": 1e300}}"#,
        ] {
            assert!(serde_json::from_str::<NewSession>(bad).is_err(), "{bad}");
        }
        let none: NewSession = serde_json::from_str(r#"{"plot_width": null}"#).unwrap();
        assert_eq!(none.plot_width, None);
    }
}

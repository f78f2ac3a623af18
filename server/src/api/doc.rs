//! The OpenAPI document the server serves at `GET /openapi.json`, and what makes it exact.
//!
//! The routes' `#[utoipa::path]` annotations say what is particular to each route (its success
//! answers, its conflicts). What every route shares is added here, in one place, from what each
//! operation declares, so a new route cannot forget it ([`CommonAnswers`]):
//!
//! | the operation has | it can answer |
//! |---|---|
//! | anything | 429 `too_many_requests` (its address has too many requests in flight before their credentials passed), 500 `internal`, 503 `request_timeout`, `store_unavailable` |
//! | path parameters, a query or a body | 400 (a parameter that does not parse, a malformed body) |
//! | a security scheme | 401 (missing, malformed or wrong credentials) |
//! | the admin token as its only scheme | 403 (client credentials on the admin API) |
//! | path parameters | 404 (no such task, round, client or job) |
//! | a JSON body | 408 (below the minimum rate), 413 (over the JSON size limit) |
//!
//! Every string path parameter is an id, and gets [`ID_PATTERN`] ([`IdPatterns`]; an upload's
//! `digest`, 64 hex digits); every unsigned integer gets the range of its Rust type
//! ([`UnsignedBounds`]), since `uint32` and `uint64` are formats a JSON Schema validator does
//! not know. Every refusal has an
//! [`ApiError`] JSON body; a known path asked with a method it does not serve answers 405 with
//! one, and an `Allow` header.

use utoipa::openapi::path::{Operation, ParameterIn};
use utoipa::openapi::schema::{ArrayItems, KnownFormat, Schema, SchemaFormat, SchemaType, Type};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, ObjectBuilder, Ref, RefOr, Response, ResponseBuilder};
use utoipa::OpenApi;

use hora_common::wire::{ApiError, ID_PATTERN};

use super::{admin, chunked, client, secagg, sync};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Hora",
        description = "Federated learning server: client API (/v1) and admin API (/admin/v1). \
            Every refusal has an `ApiError` JSON body with a stable `code`; a known path asked \
            with a method it does not serve answers 405 `method_not_allowed` with an `Allow` header."
    ),
    paths(
        super::healthz, super::readyz, super::metrics, super::openapi,
        client::enrol, client::poll, client::join, client::model, client::module, client::update,
        client::evaluation,
        chunked::start, chunked::chunk, chunked::complete,
        admin::upload_model, admin::upload_module, admin::create_task, admin::list_tasks, admin::get_task,
        admin::pause, admin::resume, admin::stop, admin::rounds, admin::round_model, admin::frozen_base,
        admin::create_enrolment, admin::list_clients, admin::revoke_client, admin::release_client,
        admin::create_sync_job, admin::list_sync_jobs, admin::delete_sync_job,
        crate::dashboard::create_link,
        sync::join, sync::status, sync::finish,
        secagg::advertise, secagg::neighbours, secagg::share, secagg::inbox, secagg::masked,
        secagg::unmask_request, secagg::unmask,
    ),
    components(schemas(ApiError)),
    modifiers(&BearerAuth, &CommonAnswers, &IdPatterns, &UnsignedBounds),
)]
pub struct ApiDoc;

/// A raw request or response body: safetensors, a sealed envelope, a TorchScript archive, masked
/// words. Used inline (`inline(Binary)`), so it is no component.
pub struct Binary;

impl utoipa::PartialSchema for Binary {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(KnownFormat::Binary)))
            .into()
    }
}

impl utoipa::ToSchema for Binary {}

/// Plain text (`/healthz`, `/metrics`), inline like [`Binary`].
pub struct Text;

impl utoipa::PartialSchema for Text {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new().schema_type(Type::String).into()
    }
}

impl utoipa::ToSchema for Text {}

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        for name in [
            "admin_token",
            "client_credentials",
            "enrolment_token",
            "sync_job_token",
        ] {
            components.add_security_scheme(
                name,
                SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
            );
        }
    }
}

/// Every operation of the document, mutably.
fn operations(openapi: &mut utoipa::openapi::OpenApi) -> impl Iterator<Item = &mut Operation> {
    openapi.paths.paths.values_mut().flat_map(|item| {
        [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.options,
            &mut item.head,
            &mut item.patch,
            &mut item.trace,
        ]
        .into_iter()
        .filter_map(Option::as_mut)
    })
}

/// An answer whose body is an [`ApiError`].
pub fn api_error(description: &str) -> Response {
    ResponseBuilder::new()
        .description(description)
        .content(
            "application/json",
            ContentBuilder::new()
                .schema(Some(Ref::from_schema_name("ApiError")))
                .build(),
        )
        .build()
}

/// Adds the answers every route shares (see the module's table) to each operation, unless the
/// route's own annotation describes that status already.
struct CommonAnswers;

impl utoipa::Modify for CommonAnswers {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for op in operations(openapi) {
            // Each requirement is an object naming its schemes; `{}` makes the scheme optional.
            let requirements: Vec<Vec<String>> = op
                .security
                .iter()
                .flatten()
                .map(|r| match serde_json::to_value(r) {
                    Ok(serde_json::Value::Object(m)) => m.keys().cloned().collect(),
                    _ => Vec::new(),
                })
                .collect();
            let params = op.parameters.as_deref().unwrap_or_default();
            let has_path = params
                .iter()
                .any(|p| matches!(p.parameter_in, ParameterIn::Path));
            let json_body = op
                .request_body
                .as_ref()
                .is_some_and(|b| b.content.contains_key("application/json"));

            let mut answers: Vec<(&str, &str)> = Vec::new();
            if !params.is_empty() || op.request_body.is_some() {
                answers.push((
                    "400",
                    "`bad_request`: a path parameter, query or body that does not parse or breaks \
                     a constraint of this document (or a route-specific code)",
                ));
            }
            if requirements.iter().any(|r| !r.is_empty()) {
                answers.push((
                    "401",
                    "`missing_credentials` (no `Authorization: Bearer …`) or `unauthorized` \
                     (unknown, malformed or revoked credentials)",
                ));
            }
            if requirements == [vec!["admin_token".to_string()]] {
                answers.push((
                    "403",
                    "`forbidden`: client credentials cannot use the admin API",
                ));
            }
            if has_path {
                answers.push((
                    "404",
                    "`not_found`: no such task, round, client or job (a client scoped to other \
                     tasks is answered this too)",
                ));
            }
            if json_body {
                answers.push((
                    "408",
                    "`upload_too_slow`: the body arrived below the server's minimum rate",
                ));
                answers.push((
                    "413",
                    "`payload_too_large`: the body is over the server's JSON size limit",
                ));
            }
            answers.push((
                "429",
                "`too_many_requests`: too many requests from this address are in flight before \
                 their credentials were checked; retry after `Retry-After` seconds",
            ));
            answers.push(("500", "`internal`: the server failed; the log says why"));
            answers.push((
                "503",
                "`request_timeout`: the server gave up on the request after its time limit, \
                 `busy`: no room to read the body in time, `store_unavailable`: the server \
                 cannot reach its database now (retry after `Retry-After` seconds), or \
                 `task_unavailable`: the task's stored state is damaged (the server log says \
                 how); retry later",
            ));
            for (status, description) in answers {
                if !op.responses.responses.contains_key(status) {
                    op.responses
                        .responses
                        .insert(status.to_string(), RefOr::T(api_error(description)));
                }
            }
        }
    }
}

/// Every string path parameter is an id ([`hora_common::wire::valid_id`]): give it the pattern.
struct IdPatterns;

impl utoipa::Modify for IdPatterns {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for op in operations(openapi) {
            for p in op.parameters.iter_mut().flatten() {
                if !matches!(p.parameter_in, ParameterIn::Path) {
                    continue;
                }
                if let Some(RefOr::T(Schema::Object(o))) = &mut p.schema {
                    if o.schema_type == SchemaType::Type(Type::String) {
                        // (An upload's digest is its plaintext's SHA-256.)
                        o.pattern = Some(match p.name.as_str() {
                            "digest" => "^[0-9a-f]{64}$".into(),
                            _ => ID_PATTERN.into(),
                        });
                    }
                }
            }
        }
    }
}

/// Gives every `uint8`…`uint64` its range as `minimum`/`maximum`: validators and fuzzers know
/// only `int32`/`int64`, and without the bounds they would take 2^64 as valid for a `u64`.
struct UnsignedBounds;

impl utoipa::Modify for UnsignedBounds {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        if let Some(components) = &mut openapi.components {
            components.schemas.values_mut().for_each(bound_unsigned);
            for response in components.responses.values_mut() {
                if let RefOr::T(r) = response {
                    bound_response(r);
                }
            }
        }
        for op in operations(openapi) {
            for p in op.parameters.iter_mut().flatten() {
                if let Some(s) = &mut p.schema {
                    bound_unsigned(s);
                }
            }
            if let Some(body) = &mut op.request_body {
                for content in body.content.values_mut() {
                    content.schema.iter_mut().for_each(bound_unsigned);
                }
            }
            for response in op.responses.responses.values_mut() {
                if let RefOr::T(r) = response {
                    bound_response(r);
                }
            }
        }
    }
}

fn bound_response(r: &mut Response) {
    for content in r.content.values_mut() {
        content.schema.iter_mut().for_each(bound_unsigned);
    }
}

fn bound_unsigned(schema: &mut RefOr<Schema>) {
    use utoipa::Number;
    let RefOr::T(schema) = schema else { return };
    match schema {
        Schema::Object(o) => {
            let max: Option<u64> = match &o.format {
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt8)) => Some(u8::MAX.into()),
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt16)) => Some(u16::MAX.into()),
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt32)) => Some(u32::MAX.into()),
                Some(SchemaFormat::KnownFormat(KnownFormat::UInt64)) => Some(u64::MAX),
                _ => None,
            };
            if let Some(max) = max {
                o.minimum.get_or_insert(Number::UInt(0));
                o.maximum.get_or_insert(Number::UInt(max as usize));
                // utoipa writes `u-int64`; `uint64` is the usual spelling.
                let bits = max.count_ones();
                o.format = Some(SchemaFormat::Custom(format!("uint{bits}")));
            }
            o.properties.values_mut().for_each(bound_unsigned);
            if let Some(extra) = &mut o.additional_properties {
                if let utoipa::openapi::schema::AdditionalProperties::RefOr(s) = extra.as_mut() {
                    bound_unsigned(s);
                }
            }
        }
        Schema::Array(a) => {
            if let ArrayItems::RefOrSchema(items) = &mut a.items {
                bound_unsigned(items);
            }
        }
        Schema::OneOf(c) => c.items.iter_mut().for_each(bound_unsigned),
        Schema::AllOf(c) => c.items.iter_mut().for_each(bound_unsigned),
        Schema::AnyOf(c) => c.items.iter_mut().for_each(bound_unsigned),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    use super::*;

    fn document() -> Value {
        serde_json::to_value(ApiDoc::openapi()).expect("the document serialises")
    }

    /// Every `"$ref"` string in `v`, with the JSON path where it sits.
    fn refs(v: &Value, at: &str, out: &mut Vec<(String, String)>) {
        match v {
            Value::Object(m) => {
                for (k, child) in m {
                    match (k.as_str(), child) {
                        ("$ref", Value::String(r)) => out.push((at.to_string(), r.clone())),
                        _ => refs(child, &format!("{at}/{k}"), out),
                    }
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    refs(child, &format!("{at}/{i}"), out);
                }
            }
            _ => {}
        }
    }

    #[test]
    fn every_ref_resolves_to_a_defined_component() {
        let doc = document();
        let mut found = Vec::new();
        refs(&doc, "", &mut found);
        assert!(
            found.len() > 50,
            "only {} refs: is the walk broken?",
            found.len()
        );
        for (at, r) in found {
            let pointer = r
                .strip_prefix('#')
                .unwrap_or_else(|| panic!("{at}: `{r}` is not a local reference"));
            assert!(
                doc.pointer(pointer).is_some_and(Value::is_object),
                "{at}: `{r}` does not resolve"
            );
        }
        for schema in ["DType", "ApiError", "CreateEnrolment"] {
            assert!(doc["components"]["schemas"][schema].is_object(), "{schema}");
        }
    }

    #[test]
    fn the_error_body_lists_every_code_the_server_answers_with() {
        let doc = document();
        let schemas = &doc["components"]["schemas"];
        assert_eq!(
            schemas["ApiError"]["properties"]["code"]["$ref"],
            "#/components/schemas/ErrorCode"
        );
        let code = &schemas["ErrorCode"];
        assert_eq!(code["type"], "string");
        let description = code["description"].as_str().expect("a description");
        let (_, listed) = description
            .split_once("answers with: ")
            .expect("the list of codes");
        let listed: Vec<&str> = listed.trim_end_matches('.').split(", ").collect();
        let known: Vec<&str> = hora_common::wire::ErrorCode::KNOWN
            .iter()
            .map(|c| c.as_str())
            .collect();
        assert_eq!(listed, known);
    }

    fn operations(doc: &Value) -> Vec<(String, String, &Value)> {
        let mut out = Vec::new();
        for (path, item) in doc["paths"].as_object().unwrap() {
            for (method, op) in item.as_object().unwrap() {
                out.push((path.clone(), method.clone(), op));
            }
        }
        out
    }

    fn statuses(op: &Value) -> BTreeSet<&str> {
        op["responses"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect()
    }

    #[test]
    fn every_operation_lists_the_shared_answers_with_api_error_bodies() {
        let doc = document();
        for (path, method, op) in operations(&doc) {
            let s = statuses(op);
            let name = format!("{method} {path}");
            for always in ["429", "500", "503"] {
                assert!(s.contains(always), "{name}: {always} missing");
            }
            if path.contains('{') {
                for status in ["400", "404"] {
                    assert!(s.contains(status), "{name}: {status} missing");
                }
            }
            if path.starts_with("/admin/") {
                for status in ["401", "403"] {
                    assert!(s.contains(status), "{name}: {status} missing");
                }
            } else if path.starts_with("/v1/") && path != "/v1/enrol" {
                assert!(s.contains("401"), "{name}: 401 missing");
            }
            for (status, answer) in op["responses"].as_object().unwrap() {
                if status.starts_with('4') || status.starts_with('5') {
                    assert_eq!(
                        answer["content"]["application/json"]["schema"]["$ref"],
                        "#/components/schemas/ApiError",
                        "{name}: {status}"
                    );
                }
            }
        }
        let paths = &doc["paths"];
        for upload in [
            "/v1/tasks/{task}/rounds/{round}/update",
            "/v1/tasks/{task}/secagg/{round}/{attempt}/masked",
        ] {
            let s = statuses(&paths[upload]["post"]);
            for status in ["408", "409", "411", "413", "503"] {
                assert!(s.contains(status), "{upload}: {status} missing");
            }
            let said = paths[upload]["post"]["responses"].to_string();
            for code in [
                "upload_too_slow",
                "upload_in_progress",
                "not_durable_yet",
                "request_timeout",
            ] {
                assert!(said.contains(code), "{upload}: `{code}` not described");
            }
        }
        assert!(statuses(&paths["/metrics"]["get"]).contains("401"));
        assert!(!statuses(&paths["/healthz"]["get"]).contains("401"));
    }

    #[test]
    fn path_ids_have_the_id_pattern_and_integers_their_range() {
        let doc = document();
        let mut ids = 0;
        for (path, method, op) in operations(&doc) {
            for p in op["parameters"].as_array().into_iter().flatten() {
                let schema = &p["schema"];
                match (p["in"].as_str(), schema["type"].as_str()) {
                    (Some("path"), Some("string")) if p["name"] == "digest" => {
                        assert_eq!(schema["pattern"], "^[0-9a-f]{64}$", "{method} {path}");
                    }
                    (Some("path"), Some("string")) => {
                        assert_eq!(schema["pattern"], ID_PATTERN, "{method} {path}");
                        ids += 1;
                    }
                    (_, Some("integer")) => {
                        assert_eq!(schema["minimum"], 0, "{method} {path}: {p}");
                        assert!(schema["maximum"].is_u64(), "{method} {path}: {p}");
                    }
                    _ => {}
                }
            }
        }
        assert!(ids > 20, "{ids}");
        for (path, method, op) in operations(&doc) {
            for p in op["parameters"].as_array().into_iter().flatten() {
                if ["after", "wait_ms"].contains(&p["name"].as_str().unwrap()) {
                    assert_eq!(p["in"], "query", "{method} {path}");
                    assert_eq!(p["required"], false, "{method} {path}");
                }
            }
        }
        let schemas = &doc["components"]["schemas"];
        let round = &doc["paths"]["/v1/tasks/{task}/rounds/{round}/update"]["post"]["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "round")
            .unwrap()["schema"];
        assert_eq!(round["maximum"], u64::MAX);
        let create = &schemas["CreateTask"]["properties"];
        assert_eq!(create["id"]["pattern"], ID_PATTERN);
        assert_eq!(
            schemas["CreateSyncJob"]["properties"]["id"]["pattern"],
            ID_PATTERN
        );
        assert_eq!(create["rounds"]["minimum"], 1);
        assert_eq!(create["min_clients"]["minimum"], 1);
        assert_eq!(create["min_clients"]["maximum"], u32::MAX);
        assert_eq!(schemas["CreateTask"]["additionalProperties"], false);
        assert_eq!(
            schemas["CreateEnrolment"]["properties"]["tasks"]["items"]["pattern"],
            ID_PATTERN
        );
    }

    /// The pattern the document gives ids is the one `valid_id` enforces, byte class by class.
    #[test]
    fn the_id_pattern_is_what_valid_id_accepts() {
        assert_eq!(ID_PATTERN, "^[A-Za-z0-9_.-]{1,64}$");
        let class = |b: u8| b.is_ascii_alphanumeric() || b"_.-".contains(&b);
        for b in 0..=255u8 {
            let one = [b];
            let s = std::str::from_utf8(&one).unwrap_or("é");
            assert_eq!(hora_common::wire::valid_id(s), class(b), "{b}");
        }
        assert!(hora_common::wire::valid_id(&"a".repeat(64)));
        assert!(!hora_common::wire::valid_id(&"a".repeat(65)));
    }
}

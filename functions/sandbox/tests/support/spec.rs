//! Contract checks against the apps' official API descriptions in `shared/api-specs` (Swagger 2.0 for Forgejo,
//! OpenAPI 3.0 YAML for Plane and Zulip, OpenAPI 3.1 JSON for GlitchTip; OpenPanel has none).
//!
//! A small validator, enough for what the fakes and the agents exchange: `$ref`, `allOf` (merged the way the
//! specs' own generators mean it), `oneOf`/`anyOf` (at least one branch), `type` (also 3.1 type lists),
//! `nullable`/`x-nullable`, `enum`, `required` (minus `readOnly` in requests and `writeOnly` in answers),
//! `properties`, `additionalProperties` and `items`. Formats, patterns, lengths and ranges are not checked.
//!
//! Shared by the sandbox's own tests and the agents' tests (`#[path]`-included there), so both read the same
//! rules and the same skip list.

use loams_sandbox::Exchange;
use serde_json::{Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Where the descriptions are: `LOAMS_API_SPECS`, else `shared/api-specs` beside the clone (CI lays a copy of
/// `shared/` there). Both test crates sit at `functions/<crate>`, so the relative path is the same.
pub fn specs_dir() -> PathBuf {
    match std::env::var_os("LOAMS_API_SPECS") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/api-specs"),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum App {
    Zulip,
    Plane,
    Forgejo,
    Glitchtip,
}

impl App {
    /// The sandbox's app name; `None` for OpenPanel, which publishes no description.
    pub fn from_name(name: &str) -> Option<App> {
        match name {
            "zulip" => Some(App::Zulip),
            "plane" => Some(App::Plane),
            "forgejo" => Some(App::Forgejo),
            "glitchtip" => Some(App::Glitchtip),
            _ => None,
        }
    }

    fn file(self) -> &'static str {
        match self {
            App::Zulip => "zulip/zulip.yaml",
            App::Plane => "plane/plane-openapi.v1.3.1.yaml",
            App::Forgejo => "forgejo/forgejo-swagger.v1.json",
            App::Glitchtip => "glitchtip/glitchtip-openapi.json",
        }
    }

    /// Whether an object schema that lists `properties` but says nothing of `additionalProperties` is closed.
    /// go-swagger (Forgejo), drf-spectacular (Plane) and django-ninja (GlitchTip) generate every field the
    /// server emits, so anything else is a deviation. Zulip's description is hand-written and says
    /// `additionalProperties: false` wherever it means closed, so there the JSON Schema default (open) holds.
    fn closed_by_default(self) -> bool {
        self != App::Zulip
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Which side of an exchange is being checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Request,
    Response,
}

/// What an exception excuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Excuse {
    /// The whole request or answer is not checked.
    Everything,
    /// An answer with a status in this range is accepted when the operation does not list that status (when it
    /// does, the listed schema still holds).
    UndocumentedStatus(u16, u16),
    /// Deviations at a field of this name (anywhere in the body) are accepted.
    Field(&'static str),
}

/// One place where an upstream description is known to be wrong or silent.
struct Skip {
    app: App,
    /// `*` for every method.
    method: &'static str,
    /// The description's path template; `*` for every operation of the app.
    template: &'static str,
    part: Part,
    excuse: Excuse,
    reason: &'static str,
}

const fn skip(
    app: App,
    method: &'static str,
    template: &'static str,
    part: Part,
    excuse: Excuse,
    reason: &'static str,
) -> Skip {
    Skip {
        app,
        method,
        template,
        part,
        excuse,
        reason,
    }
}

const PLANE_ITEM: &str = "/api/v1/workspaces/{slug}/projects/{project_id}/work-items/";
const PLANE_ITEM_ONE: &str = "/api/v1/workspaces/{slug}/projects/{project_id}/work-items/{pk}/";

/// Every exception, in one place, each with why. Nothing else is excused.
const SKIPS: &[Skip] = &[
    skip(
        App::Forgejo,
        "*",
        "*",
        Part::Response,
        Excuse::UndocumentedStatus(401, 401),
        "auth failures are global (securityDefinitions); Forgejo lists 401 on almost no operation",
    ),
    skip(
        App::Forgejo,
        "*",
        "*",
        Part::Response,
        Excuse::UndocumentedStatus(422, 422),
        "Forgejo's body binding answers 422 to any body that does not decode; only some operations list it",
    ),
    skip(
        App::Glitchtip,
        "*",
        "*",
        Part::Response,
        Excuse::UndocumentedStatus(400, 499),
        "django-ninja declares only each view's success answer; 401, 404 (get_object_or_404) and 422 are undeclared",
    ),
    skip(
        App::Plane,
        "*",
        "*",
        Part::Response,
        Excuse::UndocumentedStatus(401, 401),
        "auth failures are global (securitySchemes); drf-spectacular lists 401 without a body on some operations",
    ),
    skip(
        App::Zulip,
        "*",
        "*",
        Part::Response,
        Excuse::UndocumentedStatus(401, 401),
        "auth failures are described once (api/rest-error-handling), not per operation",
    ),
    skip(
        App::Forgejo,
        "GET",
        "/repos/{owner}/{repo}/raw/{filepath}",
        Part::Response,
        Excuse::Everything,
        "`type: file` is not a JSON Schema type (api-specs README, validation status)",
    ),
    skip(
        App::Forgejo,
        "GET",
        "/repos/{owner}/{repo}/media/{filepath}",
        Part::Response,
        Excuse::Everything,
        "`type: file` is not a JSON Schema type (api-specs README, validation status)",
    ),
    skip(
        App::Plane,
        "PATCH",
        "/api/v1/workspaces/{slug}/projects/{project_id}/issues/{issue_id}/issue-attachments/{pk}/",
        Part::Request,
        Excuse::Everything,
        "request schema nested under an `application/json` key (api-specs README, validation status)",
    ),
    skip(
        App::Plane,
        "PATCH",
        "/api/v1/workspaces/{slug}/projects/{project_id}/work-items/{issue_id}/attachments/{pk}/",
        Part::Request,
        Excuse::Everything,
        "request schema nested under an `application/json` key (api-specs README, validation status)",
    ),
    skip(
        App::Plane,
        "GET",
        "/api/v1/workspaces/{slug}/work-items/search/",
        Part::Response,
        Excuse::Everything,
        "the view answers {\"issues\": [IssueSearch]}, the spec one IssueSearch (api-specs README, known defects)",
    ),
    skip(
        App::Plane,
        "*",
        PLANE_ITEM,
        Part::Response,
        Excuse::Field("assignees"),
        "write_only serializer fields that the serializer adds back as id lists; the operation's own example has them",
    ),
    skip(
        App::Plane,
        "*",
        PLANE_ITEM,
        Part::Response,
        Excuse::Field("labels"),
        "write_only serializer fields that the serializer adds back as id lists; the operation's own example has them",
    ),
    skip(
        App::Plane,
        "*",
        PLANE_ITEM_ONE,
        Part::Response,
        Excuse::Field("assignees"),
        "write_only serializer fields that the serializer adds back as id lists; the operation's own example has them",
    ),
    skip(
        App::Plane,
        "*",
        PLANE_ITEM_ONE,
        Part::Response,
        Excuse::Field("labels"),
        "write_only serializer fields that the serializer adds back as id lists; the operation's own example has them",
    ),
];

fn excuses(app: App, method: &str, template: &str, part: Part) -> impl Iterator<Item = Excuse> {
    let method = method.to_string();
    let template = template.to_string();
    SKIPS
        .iter()
        .filter(move |s| {
            s.app == app
                && (s.method == "*" || s.method == method)
                && (s.template == "*" || s.template == template)
                && s.part == part
        })
        .map(|s| s.excuse)
}

/// Drops the errors at excused fields: an error reads `<location>: <what>`, the location ends in the field.
fn excuse_fields(errs: Vec<String>, fields: &[&str]) -> Vec<String> {
    errs.into_iter()
        .filter(|e| {
            let loc = e.split(": ").next().unwrap_or_default();
            let last = loc.rsplit('.').next().unwrap_or_default();
            let last = last.split('[').next().unwrap_or_default();
            !fields.contains(&last)
        })
        .collect()
}

pub struct Spec {
    app: App,
    doc: Value,
    /// Path prefix of the server URL that the description's paths leave out (`/api/v1` for Forgejo, Zulip).
    prefix: String,
    swagger2: bool,
}

static SPECS: [OnceLock<Spec>; 4] = [
    OnceLock::new(),
    OnceLock::new(),
    OnceLock::new(),
    OnceLock::new(),
];

/// The parsed description of `app`, loaded once per test binary. A missing or unreadable file fails the test:
/// a contract check that quietly does nothing is worse than none.
pub fn spec(app: App) -> &'static Spec {
    SPECS[app.index()].get_or_init(|| load(&specs_dir(), app).unwrap_or_else(|m| panic!("{m}")))
}

fn load(dir: &Path, app: App) -> Result<Spec, String> {
    let path = dir.join(app.file());
    let text = std::fs::read_to_string(&path).map_err(|e| {
        format!(
            "API description {} is missing ({e}): the contract tests need shared/api-specs beside the clone, \
             or LOAMS_API_SPECS set to that folder",
            path.display()
        )
    })?;
    let doc: Value = if app.file().ends_with(".yaml") {
        serde_norway::from_str(&text)
            .map_err(|e| format!("{} is not valid YAML: {e}", path.display()))?
    } else {
        serde_json::from_str(&text)
            .map_err(|e| format!("{} is not valid JSON: {e}", path.display()))?
    };
    Ok(Spec::new(app, doc))
}

impl Spec {
    fn new(app: App, doc: Value) -> Spec {
        let swagger2 = doc["swagger"] == "2.0";
        let prefix = if swagger2 {
            doc["basePath"].as_str().unwrap_or_default().to_string()
        } else {
            // The first server's path: `https://{subdomain}.zulipchat.com/api/v1` -> `/api/v1`.
            let url = doc["servers"][0]["url"].as_str().unwrap_or_default();
            let rest = url.split_once("://").map_or(url, |(_, r)| r);
            rest.find('/')
                .map_or(String::new(), |i| rest[i..].to_string())
        };
        Spec {
            app,
            doc,
            prefix: prefix.trim_end_matches('/').to_string(),
            swagger2,
        }
    }

    /// The schema at a local `$ref` (`#/components/schemas/X`, `#/definitions/X`, `#/responses/X`).
    fn deref<'a>(&'a self, mut v: &'a Value) -> Result<&'a Value, String> {
        for _ in 0..16 {
            match v.get("$ref").and_then(Value::as_str) {
                Some(r) => {
                    let pointer = r
                        .strip_prefix('#')
                        .ok_or_else(|| format!("non-local $ref {r}"))?;
                    v = self
                        .doc
                        .pointer(pointer)
                        .ok_or_else(|| format!("dangling $ref {r}"))?;
                }
                None => return Ok(v),
            }
        }
        Err("$ref chain too long".into())
    }

    /// The operation answering `method path` (path as sent, percent-encoded, without query).
    fn operation(&self, method: &str, path: &str) -> Result<Operation<'_>, String> {
        let rel = path
            .strip_prefix(self.prefix.as_str())
            .filter(|r| r.starts_with('/'))
            .ok_or_else(|| format!("path outside the API base {}", self.prefix))?;
        let got: Vec<&str> = rel.split('/').collect();
        let paths = self.doc["paths"]
            .as_object()
            .ok_or("description has no paths")?;
        let mut candidates: Vec<(usize, &str, &Value, BTreeMap<String, String>)> = Vec::new();
        for (template, item) in paths {
            let want: Vec<&str> = template.split('/').collect();
            let mut caps = BTreeMap::new();
            if let Some(score) = match_segments(&want, &got, &mut caps) {
                candidates.push((score, template, item, caps));
            }
        }
        // The most specific template wins, unless a path parameter it needs is outside its enum (a router
        // would not take `bad..ref` as `{sha}.{diffType}` with diffType in diff|patch).
        candidates.sort_by_key(|c| std::cmp::Reverse(c.0));
        let fits = |(_, _, item, caps): &(usize, &str, &Value, BTreeMap<String, String>)| {
            let Ok(item) = self.deref(item) else {
                return false;
            };
            let Some(op) = item.get(method.to_ascii_lowercase()) else {
                return false;
            };
            let o = Operation {
                template: String::new(),
                item,
                op,
                path_params: caps.clone(),
            };
            self.parameters(&o).is_ok_and(|ps| {
                ps.iter().filter(|p| p["in"] == "path").all(|p| {
                    let allowed = self.param_schema(p).get("enum").and_then(Value::as_array);
                    let value = caps
                        .get(p["name"].as_str().unwrap_or_default())
                        .map(|v| percent_decode(v));
                    allowed.is_none_or(|a| value.is_some_and(|v| a.contains(&Value::String(v))))
                })
            })
        };
        let chosen = match candidates.iter().position(fits) {
            Some(i) => candidates.swap_remove(i),
            None if candidates.is_empty() => {
                return Err("no operation in the description has this path".into());
            }
            None => candidates.swap_remove(0),
        };
        let (_, template, item, params) = chosen;
        let item = self.deref(item)?;
        let op = item
            .get(method.to_ascii_lowercase())
            .ok_or_else(|| format!("{template} has no {method} operation"))?;
        Ok(Operation {
            template: template.to_string(),
            item,
            op,
            path_params: params,
        })
    }

    /// Path-level and operation-level parameters; the operation's win on the same name and location.
    fn parameters<'a>(&'a self, o: &Operation<'a>) -> Result<Vec<&'a Value>, String> {
        let mut out: Vec<&Value> = Vec::new();
        for list in [&o.item["parameters"], &o.op["parameters"]] {
            for p in list.as_array().into_iter().flatten() {
                let p = self.deref(p)?;
                out.retain(|q| !(q["name"] == p["name"] && q["in"] == p["in"]));
                out.push(p);
            }
        }
        Ok(out)
    }

    /// Checks what a client sent: path parameters, query parameters (required ones present, no undocumented
    /// ones), and the body against the request schema.
    pub fn check_request(&self, e: &Exchange) -> Result<(), Vec<String>> {
        let o = self.operation(&e.method, &e.path).map_err(|m| vec![m])?;
        let excused: Vec<Excuse> =
            excuses(self.app, &e.method, &o.template, Part::Request).collect();
        if excused.contains(&Excuse::Everything) {
            return Ok(());
        }
        let mut errs = Vec::new();
        let params = self.parameters(&o).map_err(|m| vec![m])?;
        let query = parse_form(&e.query);
        let mut form_params: Vec<&Value> = Vec::new();
        let mut body_param = None;
        for p in &params {
            let name = p["name"].as_str().unwrap_or_default();
            match p["in"].as_str() {
                Some("path") => match o.path_params.get(name) {
                    Some(raw) => {
                        self.check_text(&percent_decode(raw), self.param_schema(p), &mut errs, name)
                    }
                    None => errs.push(format!("path parameter {name} missing")),
                },
                Some("query") => {
                    let values: Vec<&String> = query
                        .iter()
                        .filter(|(k, _)| k == name)
                        .map(|(_, v)| v)
                        .collect();
                    if values.is_empty() && p["required"] == true {
                        errs.push(format!("required query parameter {name} missing"));
                    }
                    for v in values {
                        self.check_text(v, self.param_schema(p), &mut errs, name);
                    }
                }
                Some("formData") => form_params.push(p),
                Some("body") => body_param = Some(*p),
                _ => {}
            }
        }
        for (k, _) in &query {
            let declared = params
                .iter()
                .any(|p| p["in"] == "query" && p["name"] == k.as_str());
            if !declared {
                errs.push(format!("undocumented query parameter {k}"));
            }
        }
        self.check_request_body(e, &o, body_param, &form_params, &mut errs);
        let errs = excuse_fields(errs, &fields_of(&excused));
        if errs.is_empty() { Ok(()) } else { Err(errs) }
    }

    /// Swagger 2.0 keeps a parameter's schema inline (`type`, `enum`, `items`); OpenAPI 3 under `schema`, or
    /// under `content.<media>.schema` for a JSON-encoded value (Zulip's `narrow`).
    fn param_schema<'a>(&self, p: &'a Value) -> &'a Value {
        if let Some(s) = p.get("schema") {
            return s;
        }
        if let Some(c) = p.get("content").and_then(Value::as_object)
            && let Some((_, media)) = c.iter().next()
        {
            return &media["schema"];
        }
        p
    }

    fn check_request_body(
        &self,
        e: &Exchange,
        o: &Operation<'_>,
        body_param: Option<&Value>,
        form_params: &[&Value],
        errs: &mut Vec<String>,
    ) {
        let media = media_type(&e.request_content_type);
        let empty = e.request_body.trim().is_empty();
        let (schema, required) = if self.swagger2 {
            if !form_params.is_empty() {
                self.check_form_params(&e.request_body, form_params, errs);
                return;
            }
            match body_param {
                Some(p) => (&p["schema"], p["required"] == true),
                None if empty => return,
                None => {
                    errs.push("a body was sent to an operation that takes none".into());
                    return;
                }
            }
        } else {
            let rb = match self.deref(&o.op["requestBody"]) {
                Ok(Value::Null) if empty => return,
                Ok(Value::Null) => {
                    errs.push("a body was sent to an operation that takes none".into());
                    return;
                }
                Ok(rb) => rb,
                Err(m) => {
                    errs.push(m);
                    return;
                }
            };
            if empty {
                if rb["required"] == true {
                    errs.push("required request body missing".into());
                }
                return;
            }
            match rb["content"].get(media) {
                Some(m) => (&m["schema"], rb["required"] == true),
                None => {
                    errs.push(format!(
                        "request content type {media:?} is not one the operation accepts"
                    ));
                    return;
                }
            }
        };
        if empty {
            if required {
                errs.push("required request body missing".into());
            }
            return;
        }
        if media == "application/x-www-form-urlencoded" {
            self.check_form_object(&e.request_body, schema, errs);
        } else if media.contains("json") {
            match serde_json::from_str::<Value>(&e.request_body) {
                Ok(v) => self.validate(&v, schema, Part::Request, "body", errs),
                Err(err) => errs.push(format!("body is not JSON: {err}")),
            }
        } else {
            errs.push(format!("unexpected request content type {media:?}"));
        }
    }

    /// Swagger 2.0 form fields: one `formData` parameter each.
    fn check_form_params(&self, body: &str, params: &[&Value], errs: &mut Vec<String>) {
        let fields = parse_form(body);
        for p in params {
            let name = p["name"].as_str().unwrap_or_default();
            let values: Vec<&String> = fields
                .iter()
                .filter(|(k, _)| k == name)
                .map(|(_, v)| v)
                .collect();
            if values.is_empty() && p["required"] == true {
                errs.push(format!("required form field {name} missing"));
            }
            for v in values {
                self.check_text(v, p, errs, name);
            }
        }
        for (k, _) in &fields {
            if !params.iter().any(|p| p["name"] == k.as_str()) {
                errs.push(format!("undocumented form field {k}"));
            }
        }
    }

    /// OpenAPI 3 form bodies: an object schema whose properties are the fields.
    fn check_form_object(&self, body: &str, schema: &Value, errs: &mut Vec<String>) {
        let fields = parse_form(body);
        let eff = match self.effective(schema) {
            Ok(eff) => eff,
            Err(m) => {
                errs.push(m);
                return;
            }
        };
        for r in &eff.required {
            if !fields.iter().any(|(k, _)| k == r) {
                errs.push(format!("required form field {r} missing"));
            }
        }
        for (k, v) in &fields {
            match eff.props.get(k.as_str()) {
                Some(schemas) => {
                    for s in schemas {
                        self.check_text(v, s, errs, k);
                    }
                }
                None => errs.push(format!("undocumented form field {k}")),
            }
        }
    }

    /// A query, path or form value is text; it conforms if the text itself does, or if its JSON reading does
    /// (integers, booleans and Zulip's JSON-encoded arrays and objects), or as a one-element array.
    fn check_text(&self, text: &str, schema: &Value, errs: &mut Vec<String>, at: &str) {
        let as_string = Value::String(text.to_string());
        let mut tries = vec![as_string.clone()];
        if let Ok(v) = serde_json::from_str::<Value>(text) {
            tries.push(v);
        }
        tries.push(Value::Array(vec![as_string]));
        let mut first = Vec::new();
        for (i, v) in tries.iter().enumerate() {
            let mut e = Vec::new();
            self.validate(v, schema, Part::Request, at, &mut e);
            if e.is_empty() {
                return;
            }
            if i == 0 {
                first = e;
            }
        }
        errs.extend(first);
    }

    /// Checks an answer against the operation's schema for its status (or `default`).
    pub fn check_response(&self, e: &Exchange) -> Result<(), Vec<String>> {
        let o = self.operation(&e.method, &e.path).map_err(|m| vec![m])?;
        let excused: Vec<Excuse> =
            excuses(self.app, &e.method, &o.template, Part::Response).collect();
        if excused.contains(&Excuse::Everything) {
            return Ok(());
        }
        let responses = &o.op["responses"];
        let Some(resp) = responses
            .get(e.status.to_string())
            .or_else(|| responses.get("default"))
        else {
            let allowed = excused
                .iter()
                .any(|x| matches!(x, Excuse::UndocumentedStatus(lo, hi) if (*lo..=*hi).contains(&e.status)));
            return if allowed {
                Ok(())
            } else {
                Err(vec![format!(
                    "status {} is not documented for {}",
                    e.status, o.template
                )])
            };
        };
        let resp = self.deref(resp).map_err(|m| vec![m])?;
        let media = media_type(&e.response_content_type);
        let schema = if self.swagger2 {
            &resp["schema"]
        } else {
            match resp["content"].as_object() {
                // Undescribed answer body (a 204, or an error the generator could not type): nothing to hold it to.
                None => &Value::Null,
                Some(c) => match c.get(media) {
                    Some(m) => &m["schema"],
                    None if e.response_body.is_empty() => &Value::Null,
                    None => {
                        let known: Vec<&String> = c.keys().collect();
                        return Err(vec![format!(
                            "answer content type {media:?}, described: {known:?}"
                        )]);
                    }
                },
            }
        };
        if schema.is_null() {
            return Ok(());
        }
        let value = if media.contains("json") {
            serde_json::from_str::<Value>(&e.response_body)
                .map_err(|err| vec![format!("answer is not JSON: {err}")])?
        } else {
            Value::String(e.response_body.clone())
        };
        let mut errs = Vec::new();
        self.validate(&value, schema, Part::Response, "answer", &mut errs);
        let errs = excuse_fields(errs, &fields_of(&excused));
        if errs.is_empty() { Ok(()) } else { Err(errs) }
    }

    /// The union of a schema and its `allOf` parts (recursively, through `$ref`s).
    fn effective<'a>(&'a self, schema: &'a Value) -> Result<Effective<'a>, String> {
        let mut eff = Effective::default();
        self.collect(schema, &mut eff, 0)?;
        Ok(eff)
    }

    fn collect<'a>(
        &'a self,
        schema: &'a Value,
        eff: &mut Effective<'a>,
        depth: u32,
    ) -> Result<(), String> {
        if depth > 32 {
            return Err("allOf nesting too deep".into());
        }
        let s = self.deref(schema)?;
        let Some(o) = s.as_object() else {
            // `true`/`{}`: anything; `false` would be nothing, which no description here uses.
            return Ok(());
        };
        if o.get("nullable") == Some(&Value::Bool(true))
            || o.get("x-nullable") == Some(&Value::Bool(true))
        {
            eff.nullable = true;
        }
        if o.get("readOnly") == Some(&Value::Bool(true)) {
            eff.read_only = true;
        }
        if o.get("writeOnly") == Some(&Value::Bool(true)) {
            eff.write_only = true;
        }
        match o.get("type") {
            Some(Value::String(t)) => eff.types.push(vec![t.as_str()]),
            Some(Value::Array(ts)) => eff
                .types
                .push(ts.iter().filter_map(Value::as_str).collect()),
            _ => {}
        }
        if let Some(Value::Array(e)) = o.get("enum") {
            eff.enums.push(e);
        }
        if let Some(c) = o.get("const") {
            eff.enums.push(std::slice::from_ref(c));
        }
        if let Some(Value::Object(props)) = o.get("properties") {
            for (k, v) in props {
                eff.props.entry(k.as_str()).or_default().push(v);
            }
        }
        for r in o
            .get("required")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(r) = r.as_str() {
                eff.required.insert(r);
            }
        }
        // A part that closes the object wins over parts that leave it open (Zulip's allOf pattern).
        match o.get("additionalProperties") {
            Some(Value::Bool(false)) => eff.closed = Some(Additional::Closed),
            Some(Value::Bool(true)) if eff.closed.is_none() => eff.closed = Some(Additional::Open),
            Some(v @ Value::Object(_)) if !matches!(eff.closed, Some(Additional::Closed)) => {
                eff.closed = Some(Additional::Schema(v));
            }
            _ => {}
        }
        if let Some(i) = o.get("items") {
            eff.items.push(i);
        }
        for key in ["oneOf", "anyOf"] {
            if let Some(Value::Array(alts)) = o.get(key) {
                eff.alternatives.push(alts);
            }
        }
        for part in o
            .get("allOf")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            self.collect(part, eff, depth + 1)?;
        }
        Ok(())
    }

    fn validate(&self, v: &Value, schema: &Value, part: Part, at: &str, errs: &mut Vec<String>) {
        self.validate_depth(v, schema, part, at, errs, 0);
    }

    fn validate_depth(
        &self,
        v: &Value,
        schema: &Value,
        part: Part,
        at: &str,
        errs: &mut Vec<String>,
        depth: u32,
    ) {
        if depth > 64 {
            errs.push(format!("{at}: nested too deep"));
            return;
        }
        let eff = match self.effective(schema) {
            Ok(eff) => eff,
            Err(m) => {
                errs.push(format!("{at}: {m}"));
                return;
            }
        };
        // Swagger 2.0 cannot say "nullable" and Forgejo's pointer fields are null in practice.
        if v.is_null() && (eff.nullable || self.swagger2) {
            return;
        }
        for types in &eff.types {
            if !types.iter().any(|t| has_type(v, t)) {
                errs.push(format!(
                    "{at}: {} is not of type {}",
                    short(v),
                    types.join("|")
                ));
                return;
            }
        }
        for allowed in &eff.enums {
            if !allowed.contains(v) {
                errs.push(format!(
                    "{at}: {} is not one of {}",
                    short(v),
                    Value::Array(allowed.to_vec())
                ));
            }
        }
        for alts in &eff.alternatives {
            let mut branch_errs = Vec::new();
            let ok = alts.iter().any(|alt| {
                let mut e = Vec::new();
                self.validate_depth(v, alt, part, at, &mut e, depth + 1);
                let fits = e.is_empty();
                branch_errs.extend(e);
                fits
            });
            if !ok {
                errs.push(format!(
                    "{at}: matches none of the alternatives ({})",
                    branch_errs.join("; ")
                ));
            }
        }
        match v {
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    for s in &eff.items {
                        self.validate_depth(item, s, part, &format!("{at}[{i}]"), errs, depth + 1);
                    }
                }
            }
            Value::Object(o) => self.validate_object(o, &eff, part, at, errs, depth),
            _ => {}
        }
    }

    fn validate_object(
        &self,
        o: &Map<String, Value>,
        eff: &Effective<'_>,
        part: Part,
        at: &str,
        errs: &mut Vec<String>,
        depth: u32,
    ) {
        for r in &eff.required {
            if o.contains_key(*r) {
                continue;
            }
            // readOnly fields are the server's to fill, writeOnly ones are never echoed.
            let exempt = eff.props.get(r).is_some_and(|schemas| {
                schemas.iter().any(|s| {
                    self.effective(s).is_ok_and(|p| match part {
                        Part::Request => p.read_only,
                        Part::Response => p.write_only,
                    })
                })
            });
            if !exempt {
                errs.push(format!("{at}: required field {r} missing"));
            }
        }
        for (k, val) in o {
            let here = format!("{at}.{k}");
            match eff.props.get(k.as_str()) {
                Some(schemas) => {
                    for s in schemas {
                        self.validate_depth(val, s, part, &here, errs, depth + 1);
                    }
                }
                None => match eff.closed {
                    Some(Additional::Closed) => {
                        errs.push(format!("{here}: not allowed (additionalProperties: false)"))
                    }
                    Some(Additional::Schema(s)) => {
                        self.validate_depth(val, s, part, &here, errs, depth + 1)
                    }
                    Some(Additional::Open) => {}
                    None => {
                        if self.app.closed_by_default() && !eff.props.is_empty() {
                            errs.push(format!("{here}: not in the schema's properties"));
                        }
                    }
                },
            }
        }
    }
}

fn fields_of(excused: &[Excuse]) -> Vec<&'static str> {
    excused
        .iter()
        .filter_map(|x| match x {
            Excuse::Field(f) => Some(*f),
            _ => None,
        })
        .collect()
}

struct Operation<'a> {
    template: String,
    item: &'a Value,
    op: &'a Value,
    /// Raw (still percent-encoded) values of the template's `{params}`.
    path_params: BTreeMap<String, String>,
}

#[derive(Default)]
struct Effective<'a> {
    nullable: bool,
    read_only: bool,
    write_only: bool,
    /// Each entry is one `type` constraint (all must hold; a 3.1 list is any of).
    types: Vec<Vec<&'a str>>,
    enums: Vec<&'a [Value]>,
    props: BTreeMap<&'a str, Vec<&'a Value>>,
    required: BTreeSet<&'a str>,
    closed: Option<Additional<'a>>,
    items: Vec<&'a Value>,
    alternatives: Vec<&'a Vec<Value>>,
}

enum Additional<'a> {
    Closed,
    Open,
    Schema(&'a Value),
}

fn has_type(v: &Value, t: &str) -> bool {
    match t {
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "array" => v.is_array(),
        "object" => v.is_object(),
        "null" => v.is_null(),
        _ => false,
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

fn media_type(content_type: &str) -> &str {
    content_type.split(';').next().unwrap_or_default().trim()
}

/// Matches path segments against template segments. A segment that is exactly one `{param}` may take several
/// segments (Forgejo's `{filepath}`, branch names with `/`); other segments mix literals and params
/// (`{sha}.{diffType}`). Returns the count of literal characters matched, so the most specific template wins.
fn match_segments(
    want: &[&str],
    got: &[&str],
    caps: &mut BTreeMap<String, String>,
) -> Option<usize> {
    let (Some(w), Some(g)) = (want.first(), got.first()) else {
        return (want.is_empty() && got.is_empty()).then_some(0);
    };
    if let Some(name) = whole_param(w) {
        // Greedy from the longest so a trailing `{filepath}` takes the rest, but keep the most specific fit.
        let mut best: Option<(usize, BTreeMap<String, String>)> = None;
        for take in (1..=got.len()).rev() {
            if got[..take].iter().any(|s| s.is_empty()) {
                continue;
            }
            let mut c = caps.clone();
            c.insert(name.to_string(), got[..take].join("/"));
            if let Some(score) = match_segments(&want[1..], &got[take..], &mut c)
                && best.as_ref().is_none_or(|b| score > b.0)
            {
                best = Some((score, c));
            }
        }
        let (score, c) = best?;
        *caps = c;
        return Some(score);
    }
    let lit = match_mixed(w, g, caps)?;
    match_segments(&want[1..], &got[1..], caps).map(|s| s + lit)
}

fn whole_param(seg: &str) -> Option<&str> {
    let inner = seg.strip_prefix('{')?.strip_suffix('}')?;
    (!inner.contains(['{', '}'])).then_some(inner)
}

/// One segment of literals and `{params}`, each param taking at least one character up to the next literal.
fn match_mixed(want: &str, got: &str, caps: &mut BTreeMap<String, String>) -> Option<usize> {
    let Some(open) = want.find('{') else {
        return (want == got).then_some(want.len());
    };
    let (lit, rest) = want.split_at(open);
    let got = got.strip_prefix(lit)?;
    let close = rest.find('}')?;
    let name = &rest[1..close];
    let after = &rest[close + 1..];
    // The param ends where the rest of the template can still match; try the shortest value first.
    for end in 1..=got.len() {
        if !got.is_char_boundary(end) {
            continue;
        }
        let mut c = caps.clone();
        c.insert(name.to_string(), got[..end].to_string());
        if let Some(n) = match_mixed(after, &got[end..], &mut c) {
            *caps = c;
            return Some(lit.len() + n);
        }
    }
    None
}

/// `a=1&b=x%20y+z` -> [("a", "1"), ("b", "x y z")].
fn parse_form(s: &str) -> Vec<(String, String)> {
    s.split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (
                percent_decode(&k.replace('+', " ")),
                percent_decode(&v.replace('+', " ")),
            )
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && let (Some(h), Some(l)) = (
                b.get(i + 1).and_then(|c| hex(*c)),
                b.get(i + 2).and_then(|c| hex(*c)),
            )
        {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Checks every recorded exchange of a described app: the answers always, the requests when `requests` is
/// set (the agents' tests; the sandbox's own tests send invalid requests on purpose). Panics listing every
/// deviation. Returns how many exchanges were checked so a caller can insist the check was not vacuous.
pub fn assert_exchanges_conform(exchanges: &[Exchange], requests: bool) -> usize {
    let mut problems = Vec::new();
    let mut checked = 0;
    for e in exchanges {
        let Some(app) = App::from_name(&e.app) else {
            continue;
        };
        checked += 1;
        let spec = spec(app);
        let q = if e.query.is_empty() {
            String::new()
        } else {
            format!("?{}", e.query)
        };
        let label = format!("{} {} {}{q} -> {}", e.app, e.method, e.path, e.status);
        if requests && let Err(errs) = spec.check_request(e) {
            problems.push(format!(
                "{label}\n  request: {}",
                errs.join("\n  request: ")
            ));
        }
        if let Err(errs) = spec.check_response(e) {
            problems.push(format!("{label}\n  answer: {}", errs.join("\n  answer: ")));
        }
    }
    assert!(
        problems.is_empty(),
        "{} exchange(s) deviate from the API descriptions:\n{}",
        problems.len(),
        problems.join("\n")
    );
    checked
}

#[cfg(test)]
mod tests {
    //! The validator itself, on small hand-written descriptions, so a check that silently accepts everything
    //! would fail here.
    use super::*;
    use serde_json::json;

    fn doc(app: App, d: Value) -> Spec {
        Spec::new(app, d)
    }

    fn errors(s: &Spec, v: Value, schema: Value) -> Vec<String> {
        let mut e = Vec::new();
        s.validate(&v, &schema, Part::Response, "x", &mut e);
        e
    }

    #[test]
    fn types_required_enum_closed_and_nullable() {
        let s = doc(App::Plane, json!({"openapi": "3.0.3", "paths": {}}));
        let schema = json!({"type": "object", "required": ["a"],
            "properties": {"a": {"type": "integer"}, "b": {"type": "string", "enum": ["x", "y"], "nullable": true}}});
        assert!(errors(&s, json!({"a": 1, "b": "x"}), schema.clone()).is_empty());
        assert!(errors(&s, json!({"a": 1, "b": null}), schema.clone()).is_empty());
        assert_eq!(
            errors(&s, json!({"b": "x"}), schema.clone()).len(),
            1,
            "a is required"
        );
        assert_eq!(
            errors(&s, json!({"a": "1"}), schema.clone()).len(),
            1,
            "a is an integer"
        );
        assert_eq!(
            errors(&s, json!({"a": 1, "b": "z"}), schema.clone()).len(),
            1,
            "enum"
        );
        assert_eq!(
            errors(&s, json!({"a": 1, "c": 0}), schema.clone()).len(),
            1,
            "closed by default"
        );
        // Zulip: open unless it says additionalProperties: false
        let z = doc(App::Zulip, json!({"openapi": "3.0.1", "paths": {}}));
        assert!(errors(&z, json!({"a": 1, "c": 0}), schema).is_empty());
    }

    #[test]
    fn refs_all_of_and_one_of() {
        let s = doc(
            App::Zulip,
            json!({"openapi": "3.0.1", "paths": {}, "components": {"schemas": {
                "Base": {"allOf": [{"required": ["result"], "properties": {"result": {"enum": ["success"]}}}]}}}}),
        );
        let schema = json!({"allOf": [{"$ref": "#/components/schemas/Base"},
            {"additionalProperties": false, "required": ["id"], "properties": {"result": {}, "id": {"type": "integer"}}}]});
        assert!(errors(&s, json!({"result": "success", "id": 3}), schema.clone()).is_empty());
        assert_eq!(
            errors(&s, json!({"result": "error", "id": 3}), schema.clone()).len(),
            1
        );
        assert_eq!(
            errors(&s, json!({"result": "success", "id": 3, "x": 1}), schema).len(),
            1
        );
        let one_of =
            json!({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "integer"}}]});
        assert!(errors(&s, json!([1, 2]), one_of.clone()).is_empty());
        assert_eq!(errors(&s, json!(["a"]), one_of).len(), 1);
        let t31 = json!({"anyOf": [{"type": "integer"}, {"type": "null"}]});
        assert!(errors(&s, Value::Null, t31.clone()).is_empty());
        assert_eq!(errors(&s, Value::Null, json!({"type": "integer"})).len(), 1);
    }

    #[test]
    fn operations_by_path_and_requests() {
        let s = doc(
            App::Forgejo,
            json!({"swagger": "2.0", "basePath": "/api/v1", "paths": {
                "/repos/{owner}/{repo}/branches/{branch}": {"get": {"responses": {}}},
                "/repos/{owner}/{repo}/contents/{filepath}": {"get": {"parameters": [
                    {"name": "ref", "in": "query", "type": "string"}], "responses": {}}},
                "/repos/{owner}/{repo}/pulls/{index}/merge": {"post": {"parameters": [
                    {"name": "index", "in": "path", "type": "integer", "required": true},
                    {"name": "body", "in": "body", "schema": {"type": "object", "required": ["Do"],
                        "properties": {"Do": {"type": "string", "enum": ["merge"]}}}}], "responses": {}}},
                "/repos/{owner}/{repo}/git/commits/{sha}.{diffType}": {"get": {"parameters": [
                    {"name": "diffType", "in": "path", "type": "string", "enum": ["diff", "patch"]}], "responses": {}}}}}),
        );
        let op = |m: &str, p: &str| s.operation(m, p).map(|o| (o.template, o.path_params));
        let (t, caps) = op("GET", "/api/v1/repos/a/b/branches/loams/r-1").unwrap_or_default();
        assert_eq!(
            (t.as_str(), caps["branch"].as_str()),
            ("/repos/{owner}/{repo}/branches/{branch}", "loams/r-1")
        );
        let (t, _) = op("POST", "/api/v1/repos/a/b/pulls/3/merge").unwrap_or_default();
        assert_eq!(t, "/repos/{owner}/{repo}/pulls/{index}/merge");
        let (_, caps) = op("GET", "/api/v1/repos/a/b/git/commits/abc.diff").unwrap_or_default();
        assert_eq!(
            (caps["sha"].as_str(), caps["diffType"].as_str()),
            ("abc", "diff")
        );
        assert!(op("DELETE", "/api/v1/repos/a/b/pulls/3/merge").is_err());
        assert!(op("GET", "/elsewhere").is_err());

        let ex = |method: &str, path: &str, query: &str, body: &str| Exchange {
            app: "forgejo".into(),
            method: method.into(),
            path: path.into(),
            query: query.into(),
            request_content_type: "application/json".into(),
            request_body: body.into(),
            status: 200,
            response_content_type: String::new(),
            response_body: String::new(),
        };
        assert!(
            s.check_request(&ex(
                "POST",
                "/api/v1/repos/a/b/pulls/3/merge",
                "",
                r#"{"Do":"merge"}"#
            ))
            .is_ok()
        );
        assert!(
            s.check_request(&ex(
                "POST",
                "/api/v1/repos/a/b/pulls/x/merge",
                "",
                r#"{"Do":"merge"}"#
            ))
            .is_err()
        );
        assert!(
            s.check_request(&ex(
                "POST",
                "/api/v1/repos/a/b/pulls/3/merge",
                "",
                r#"{"Do":"rebase"}"#
            ))
            .is_err()
        );
        assert!(
            s.check_request(&ex(
                "GET",
                "/api/v1/repos/a/b/contents/src/x.py",
                "ref=main",
                ""
            ))
            .is_ok()
        );
        assert!(
            s.check_request(&ex(
                "GET",
                "/api/v1/repos/a/b/contents/src/x.py",
                "branch=main",
                ""
            ))
            .is_err()
        );
        assert!(
            s.check_request(&ex("GET", "/api/v1/repos/a/b/git/commits/abc.txt", "", ""))
                .is_err()
        );
    }

    #[test]
    fn forms_and_text_values() {
        assert_eq!(
            parse_form("a=1&b=x%20y+z&c"),
            vec![
                ("a".into(), "1".into()),
                ("b".into(), "x y z".into()),
                ("c".into(), String::new())
            ]
        );
        assert_eq!(percent_decode("loams%2Fr-1"), "loams/r-1");
    }

    #[test]
    fn a_missing_description_is_an_error_naming_the_override() {
        let err = load(Path::new("/nonexistent-loams-specs"), App::Zulip)
            .err()
            .unwrap_or_default();
        assert!(
            err.contains("zulip/zulip.yaml") && err.contains("LOAMS_API_SPECS"),
            "{err}"
        );
    }

    fn exchange(
        app: &str,
        method: &str,
        path: &str,
        query: &str,
        body: (&str, &str),
        status: u16,
        answer: Value,
    ) -> Exchange {
        Exchange {
            app: app.into(),
            method: method.into(),
            path: path.into(),
            query: query.into(),
            request_content_type: body.0.into(),
            request_body: body.1.into(),
            status,
            response_content_type: "application/json".into(),
            response_body: answer.to_string(),
        }
    }

    #[test]
    fn the_real_descriptions_catch_deviations() {
        let (z, f, p) = (spec(App::Zulip), spec(App::Forgejo), spec(App::Plane));
        let form = (
            "application/x-www-form-urlencoded",
            "type=stream&to=factory&topic=t&content=x",
        );
        let sent =
            |answer: Value| exchange("zulip", "POST", "/api/v1/messages", "", form, 200, answer);
        assert!(
            z.check_response(&sent(json!({"result": "success", "msg": "", "id": 1})))
                .is_ok()
        );
        assert!(
            z.check_response(&sent(
                json!({"result": "success", "msg": "", "id": 1, "x": 2})
            ))
            .is_err()
        );
        assert!(
            z.check_response(&sent(json!({"result": "success", "msg": ""})))
                .is_err()
        );
        assert!(z.check_request(&sent(Value::Null)).is_ok());
        let no_content = (
            "application/x-www-form-urlencoded",
            "type=stream&to=factory&topic=t",
        );
        assert!(
            z.check_request(&exchange(
                "zulip",
                "POST",
                "/api/v1/messages",
                "",
                no_content,
                200,
                Value::Null
            ))
            .is_err()
        );
        let read = |q: &str| {
            exchange(
                "zulip",
                "GET",
                "/api/v1/messages",
                q,
                ("", ""),
                200,
                Value::Null,
            )
        };
        assert!(
            z.check_request(&read("anchor=newest&num_before=5&narrow=%5B%5D"))
                .is_ok()
        );
        assert!(
            z.check_request(&read("anchor=newest&num_before=five"))
                .is_err()
        );
        assert!(z.check_request(&read("anchor=newest&bogus=1")).is_err());

        let labels = |answer: Value| {
            exchange(
                "forgejo",
                "GET",
                "/api/v1/repos/a/b/labels",
                "",
                ("", ""),
                200,
                answer,
            )
        };
        assert!(f.check_response(&labels(json!([]))).is_ok());
        assert!(
            f.check_response(&labels(json!([{"id": 1, "name": "bug"}])))
                .is_ok()
        );
        assert!(f.check_response(&labels(json!([{"id": "1"}]))).is_err());
        assert!(
            f.check_response(&labels(json!([{"id": 1, "bogus": true}])))
                .is_err()
        );
        assert!(
            f.check_response(&exchange(
                "forgejo",
                "GET",
                "/api/v1/repos/a/b/labels",
                "",
                ("", ""),
                418,
                json!({})
            ))
            .is_err()
        );

        let create = |body: &str| {
            exchange(
                "plane",
                "POST",
                "/api/v1/workspaces/w/projects/p/work-items/",
                "",
                ("application/json", body),
                201,
                Value::Null,
            )
        };
        assert!(
            p.check_request(&create(r#"{"name": "x", "external_id": "e"}"#))
                .is_ok()
        );
        assert!(p.check_request(&create(r#"{"title": "x"}"#)).is_err());
        assert!(
            p.check_request(&create(r#"{"name": "x", "priority": "very"}"#))
                .is_err()
        );
    }

    #[test]
    fn every_exception_names_a_real_operation_and_a_reason() {
        for s in SKIPS {
            assert!(!s.reason.is_empty());
            let paths = &spec(s.app).doc["paths"];
            if s.template != "*" {
                let item = &paths[s.template];
                assert!(
                    item.is_object(),
                    "{:?} {} is not in the description",
                    s.app,
                    s.template
                );
                if s.method != "*" {
                    let m = s.method.to_ascii_lowercase();
                    assert!(
                        item.get(&m).is_some(),
                        "{:?} {} {} is not in the description",
                        s.app,
                        s.method,
                        s.template
                    );
                }
            }
        }
    }

    #[test]
    fn the_real_descriptions_load_with_their_base_paths() {
        assert_eq!(spec(App::Forgejo).prefix, "/api/v1");
        assert_eq!(spec(App::Zulip).prefix, "/api/v1");
        assert_eq!(spec(App::Plane).prefix, "");
        assert_eq!(spec(App::Glitchtip).prefix, "");
    }
}

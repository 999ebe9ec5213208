//! Fake OpenPanel export API: `GET /export/charts`, counting the seeded error event from the production model.

use crate::util::{self, DAY_MS, civil_from_days, days_from_civil};
use crate::{Shared, State as AppState};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;

/// More buckets than this is a 400 (a minute interval over a year would otherwise be huge).
const MAX_BUCKETS: usize = 2000;
const MAX_SERIES: usize = 20;

pub(crate) fn router() -> Router<Arc<Shared>> {
    Router::new().route("/export/charts", get(charts))
}

fn error(status: StatusCode, message: &str) -> Response {
    let name = status.canonical_reason().unwrap_or("Error");
    (
        status,
        Json(json!({"statusCode": status.as_u16(), "error": name, "message": message})),
    )
        .into_response()
}

fn authorize(shared: &Shared, headers: &HeaderMap) -> Result<(), Response> {
    let t = &shared.config.tokens;
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    match (get("openpanel-client-id"), get("openpanel-client-secret")) {
        (Some(id), Some(secret))
            if id == t.openpanel_client_id && secret == t.openpanel_client_secret =>
        {
            Ok(())
        }
        (None, _) | (_, None) => Err((
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "Unauthorized", "message": "Missing client id or secret"})),
        )
            .into_response()),
        _ => Err((
            StatusCode::UNAUTHORIZED,
            Json(json!({"error": "Unauthorized", "message": "Invalid client"})),
        )
            .into_response()),
    }
}

#[derive(Deserialize)]
struct SeriesItem {
    name: String,
    #[serde(default)]
    id: Option<String>,
}

#[derive(Clone, Copy)]
enum Interval {
    Minute,
    Hour,
    Day,
    Week,
    Month,
}

impl Interval {
    fn parse(s: &str) -> Option<Interval> {
        Some(match s {
            "minute" => Interval::Minute,
            "hour" => Interval::Hour,
            "day" => Interval::Day,
            "week" => Interval::Week,
            "month" => Interval::Month,
            _ => return None,
        })
    }

    /// Start of the bucket holding `t` (UTC; weeks start on Monday).
    fn floor(self, t: i64) -> i64 {
        let fixed = |size: i64, offset: i64| (t - offset).div_euclid(size) * size + offset;
        match self {
            Interval::Minute => fixed(60_000, 0),
            Interval::Hour => fixed(3_600_000, 0),
            Interval::Day => fixed(DAY_MS, 0),
            // 1970-01-05 was a Monday
            Interval::Week => fixed(7 * DAY_MS, 4 * DAY_MS),
            Interval::Month => {
                let (y, m, _) = civil_from_days(t.div_euclid(DAY_MS));
                days_from_civil(y, m, 1) * DAY_MS
            }
        }
    }

    fn next(self, start: i64) -> i64 {
        match self {
            Interval::Month => {
                let (y, m, _) = civil_from_days(start.div_euclid(DAY_MS));
                let (y, m) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                days_from_civil(y, m, 1) * DAY_MS
            }
            Interval::Minute => start + 60_000,
            Interval::Hour => start + 3_600_000,
            Interval::Day => start + DAY_MS,
            Interval::Week => start + 7 * DAY_MS,
        }
    }
}

/// `[start, end)` of a named range, relative to `now` (OpenPanel's `range` values; calendar ones in UTC).
fn range_bounds(range: &str, now: i64) -> Option<(i64, i64)> {
    let today = now.div_euclid(DAY_MS) * DAY_MS;
    let (y, m, _) = civil_from_days(now.div_euclid(DAY_MS));
    let month_start = days_from_civil(y, m, 1) * DAY_MS;
    Some(match range {
        "30min" => (now - 30 * 60_000, now + 1),
        "lastHour" => (now - 3_600_000, now + 1),
        "last24h" => (now - DAY_MS, now + 1),
        "today" => (today, now + 1),
        "yesterday" => (today - DAY_MS, today),
        "7d" => (now - 7 * DAY_MS, now + 1),
        "30d" => (now - 30 * DAY_MS, now + 1),
        "3m" => (now - 90 * DAY_MS, now + 1),
        "6m" => (now - 180 * DAY_MS, now + 1),
        "12m" => (now - 365 * DAY_MS, now + 1),
        "monthToDate" => (month_start, now + 1),
        "lastMonth" => {
            let (py, pm) = if m == 1 { (y - 1, 12) } else { (y, m - 1) };
            (days_from_civil(py, pm, 1) * DAY_MS, month_start)
        }
        "yearToDate" => (days_from_civil(y, 1, 1) * DAY_MS, now + 1),
        "lastYear" => (
            days_from_civil(y - 1, 1, 1) * DAY_MS,
            days_from_civil(y, 1, 1) * DAY_MS,
        ),
        _ => return None,
    })
}

fn metrics(counts: &[u64]) -> Value {
    let sum: u64 = counts.iter().sum();
    let n = counts.len() as u64;
    json!({
        "sum": sum,
        "average": if n == 0 { 0.0 } else { sum as f64 / n as f64 },
        "min": counts.iter().min().copied().unwrap_or(0),
        "max": counts.iter().max().copied().unwrap_or(0),
        "count": n,
    })
}

async fn charts(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    if let Err(r) = authorize(&shared, &headers) {
        return r;
    }
    let bad = |m: &str| error(StatusCode::BAD_REQUEST, m);
    match q.get("projectId") {
        None => return bad("querystring/projectId: Required"),
        Some(p) if *p != shared.config.openpanel.project_id => {
            return error(StatusCode::NOT_FOUND, "Project not found");
        }
        Some(_) => {}
    }
    // `series` is current, `events` the legacy alias; both arrive JSON-encoded in the query string
    let Some(raw) = q.get("series").or_else(|| q.get("events")) else {
        return bad("querystring/series: Required");
    };
    let series: Vec<SeriesItem> = match serde_json::from_str(raw) {
        Ok(s) => s,
        Err(e) => return bad(&format!("querystring/series: {e}")),
    };
    if series.is_empty() || series.len() > MAX_SERIES {
        return bad(&format!(
            "querystring/series: between 1 and {MAX_SERIES} series"
        ));
    }
    let Some(interval) = Interval::parse(q.get("interval").map_or("day", String::as_str)) else {
        return bad("querystring/interval: Invalid enum value");
    };
    let now = util::now_ms();
    let range = q.get("range").map_or("7d", String::as_str);
    let (start, end) = if range == "custom" || q.contains_key("startDate") {
        let parse = |k: &str| q.get(k).and_then(|v| util::parse_date(v));
        match (
            parse("startDate"),
            q.get("endDate").map(|v| util::parse_date(v)),
        ) {
            (Some(s), None) => (s, now + 1),
            // a bare end date means the whole of that day
            (Some(s), Some(Some(e))) => (
                s,
                if q.get("endDate").is_some_and(|v| v.len() == 10) {
                    e + DAY_MS
                } else {
                    e + 1
                },
            ),
            _ => return bad("querystring/startDate: a date is required for a custom range"),
        }
    } else {
        match range_bounds(range, now) {
            Some(b) => b,
            None => return bad("querystring/range: Invalid enum value"),
        }
    };
    if end <= start {
        return bad("querystring/endDate: must be after startDate");
    }
    let mut buckets = Vec::new();
    let mut b = interval.floor(start);
    while b < end {
        if buckets.len() == MAX_BUCKETS {
            return bad("too many data points: choose a larger interval or a shorter range");
        }
        let n = interval.next(b);
        buckets.push((b, n));
        b = n;
    }

    let st: std::sync::MutexGuard<'_, AppState> = shared.lock();
    let mut all = Vec::new();
    let out: Vec<Value> = series
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let counts: Vec<u64> = buckets
                .iter()
                .map(|&(a, z)| {
                    if s.name == shared.config.openpanel.event {
                        st.glitchtip.count_between(a.max(start), z.min(end), now)
                    } else {
                        0
                    }
                })
                .collect();
            all.extend_from_slice(&counts);
            let id = s.id.clone().unwrap_or_else(|| format!("{i}"));
            json!({
                "id": id,
                "names": [s.name],
                "event": {"id": id, "name": s.name},
                "metrics": metrics(&counts),
                "data": buckets.iter().zip(&counts).map(|(&(a, _), c)| json!({"date": util::iso_ms(a), "count": c})).collect::<Vec<_>>(),
            })
        })
        .collect();
    Json(json!({"series": out, "metrics": metrics(&all)})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_align() {
        let t = util::parse_date("2026-11-30T14:31:05Z").unwrap_or_default();
        assert_eq!(util::iso_s(Interval::Hour.floor(t)), "2026-11-30T14:00:00Z");
        // 2026-11-30 is a Monday
        assert_eq!(util::iso_s(Interval::Week.floor(t)), "2026-11-30T00:00:00Z");
        assert_eq!(
            util::iso_s(Interval::Month.next(Interval::Month.floor(t))),
            "2026-12-01T00:00:00Z"
        );
        assert_eq!(
            Interval::Day.next(Interval::Day.floor(t)) - Interval::Day.floor(t),
            DAY_MS
        );
    }
}

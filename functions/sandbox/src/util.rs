//! Small helpers shared by the fake apps: wall-clock time, date formatting and parsing, hashing, ids.

use aws_lc_rs::digest;
use std::time::{SystemTime, UNIX_EPOCH};

pub(crate) const DAY_MS: i64 = 86_400_000;

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Days since 1970-01-01 -> (year, month, day), proleptic Gregorian (H. Hinnant's algorithm).
pub(crate) fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

pub(crate) fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `2026-11-30T14:31:00.123Z`
pub(crate) fn iso_ms(ms: i64) -> String {
    let (y, mo, d) = civil_from_days(ms.div_euclid(DAY_MS));
    let rem = ms.rem_euclid(DAY_MS);
    let (h, mi, s, milli) = (
        rem / 3_600_000,
        rem / 60_000 % 60,
        rem / 1000 % 60,
        rem % 1000,
    );
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}.{milli:03}Z")
}

/// `2026-11-30T14:31:00Z` (Forgejo style, whole seconds)
pub(crate) fn iso_s(ms: i64) -> String {
    let full = iso_ms(ms);
    format!("{}Z", &full[..19])
}

/// Parses `YYYY-MM-DD`, `YYYY-MM-DD HH:MM:SS` or `YYYY-MM-DDTHH:MM:SS[.fff][Z]` (UTC) into epoch ms.
pub(crate) fn parse_date(s: &str) -> Option<i64> {
    let s = s.trim().trim_end_matches('Z');
    let b = s.as_bytes();
    if b.len() < 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| s.get(r).and_then(|x| x.parse::<u32>().ok());
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return None;
    }
    let mut ms = days_from_civil(i64::from(y), mo, d) * DAY_MS;
    if b.len() > 10 {
        if b.len() < 19 || !(b[10] == b'T' || b[10] == b' ') {
            return None;
        }
        let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if h > 23 || mi > 59 || sec > 60 {
            return None;
        }
        ms += i64::from(h) * 3_600_000 + i64::from(mi) * 60_000 + i64::from(sec) * 1000;
        if let Some(frac) = s.get(19..).filter(|f| !f.is_empty()) {
            let digits = frac.strip_prefix('.')?;
            let millis: String = digits.chars().chain("000".chars()).take(3).collect();
            ms += i64::from(millis.parse::<u32>().ok()?);
        }
    }
    Some(ms)
}

pub(crate) fn sha1_hex(data: &[u8]) -> String {
    hex::encode(digest::digest(&digest::SHA1_FOR_LEGACY_USE_ONLY, data).as_ref())
}

pub(crate) fn sha256_hex(data: &[u8]) -> String {
    hex::encode(digest::digest(&digest::SHA256, data).as_ref())
}

/// A deterministic version-4-shaped UUID from the given parts, so ids survive a restart from the state file
/// and tests can predict them.
pub(crate) fn uuid_from(parts: &[&str]) -> String {
    let h = sha256_hex(parts.join("\u{1f}").as_bytes());
    format!(
        "{}-{}-4{}-{}{}-{}",
        &h[0..8],
        &h[8..12],
        &h[13..16],
        // variant bits 10xx
        ["8", "9", "a", "b"][usize::from(h.as_bytes()[16] % 4)],
        &h[17..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_round_trip() {
        let ms = parse_date("2026-11-30T14:31:05.250Z").unwrap_or_default();
        assert_eq!(iso_ms(ms), "2026-11-30T14:31:05.250Z");
        assert_eq!(iso_s(ms), "2026-11-30T14:31:05Z");
        assert_eq!(parse_date("1970-01-02"), Some(DAY_MS));
        assert_eq!(
            parse_date("2024-02-29 01:00:00"),
            Some(days_from_civil(2024, 2, 29) * DAY_MS + 3_600_000)
        );
        assert_eq!(parse_date("2024-13-01"), None);
        assert_eq!(parse_date("nope"), None);
    }

    #[test]
    fn uuid_shape() {
        let u = uuid_from(&["a", "b"]);
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert_ne!(u, uuid_from(&["a", "c"]));
    }
}

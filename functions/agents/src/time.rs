//! RFC 3339 <-> epoch milliseconds, UTC only: the apps speak ISO timestamps and the contracts speak epoch ms.

use loams_platform::calendar::{DAY_MS, civil_from_days, days_from_civil};

/// Parses `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)`; `None` for anything else.
pub(crate) fn parse_rfc3339_ms(s: &str) -> Option<i64> {
    let s = s.trim();
    let b = s.as_bytes();
    if b.len() < 20
        || b[4] != b'-'
        || b[7] != b'-'
        || !(b[10] == b'T' || b[10] == b't' || b[10] == b' ')
    {
        return None;
    }
    if b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let part = s.get(r)?;
        if part.bytes().all(|c| c.is_ascii_digit()) {
            part.parse().ok()
        } else {
            None
        }
    };
    let (y, mo, d, h, mi, sec) = (
        num(0..4)?,
        num(5..7)?,
        num(8..10)?,
        num(11..13)?,
        num(14..16)?,
        num(17..19)?,
    );
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    let mut rest = &s[19..];
    let mut millis = 0;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let padded: String = frac[..digits].chars().chain("00".chars()).take(3).collect();
        millis = padded.parse::<i64>().ok()?;
        rest = &frac[digits..];
    }
    let offset_ms = match rest {
        "Z" | "z" => 0,
        _ => {
            let sign = match rest.as_bytes().first()? {
                b'+' => 1,
                b'-' => -1,
                _ => return None,
            };
            let hh: i64 = rest.get(1..3)?.parse().ok()?;
            let mm: i64 = rest.get(4..6)?.parse().ok()?;
            if rest.len() != 6 || rest.as_bytes()[3] != b':' {
                return None;
            }
            sign * (hh * 3_600_000 + mm * 60_000)
        }
    };
    // In range: checked above.
    let ms = days_from_civil(y, mo as u32, d as u32) * DAY_MS
        + h * 3_600_000
        + mi * 60_000
        + sec * 1000
        + millis;
    Some(ms - offset_ms)
}

/// An HTTP date in the IMF-fixdate form every current server sends (`Sun, 06 Nov 1994 08:49:37 GMT`, RFC 9110
/// section 5.6.7) as epoch ms; `None` for anything else, including the obsolete RFC 850 and asctime forms.
pub(crate) fn parse_http_date_ms(s: &str) -> Option<i64> {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let parts: Vec<&str> = s.split_ascii_whitespace().collect();
    let [weekday, day, month, year, clock, "GMT"] = parts.as_slice() else {
        return None;
    };
    if weekday.len() != 4 || !weekday.ends_with(',') || day.len() != 2 || year.len() != 4 {
        return None;
    }
    let num = |t: &str| -> Option<i64> {
        if t.bytes().all(|c| c.is_ascii_digit()) {
            t.parse().ok()
        } else {
            None
        }
    };
    let m = MONTHS.iter().position(|name| name == month)? as i64 + 1;
    let (d, y) = (num(day)?, num(year)?);
    let hms: Vec<&str> = clock.split(':').collect();
    let [h, mi, sec] = hms.as_slice() else {
        return None;
    };
    if [h, mi, sec].iter().any(|t| t.len() != 2) {
        return None;
    }
    let (h, mi, sec) = (num(h)?, num(mi)?, num(sec)?);
    if !(1..=31).contains(&d) || h > 23 || mi > 59 || sec > 60 {
        return None;
    }
    Some(days_from_civil(y, m as u32, d as u32) * DAY_MS + h * 3_600_000 + mi * 60_000 + sec * 1000)
}

/// `YYYY-MM-DD HH:MM:SS` in UTC (OpenPanel's `startDate` / `endDate` form).
pub(crate) fn format_utc_seconds(ms: i64) -> String {
    let (y, m, d) = civil_from_days(ms.div_euclid(DAY_MS));
    let rem = ms.rem_euclid(DAY_MS) / 1000;
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// The first whole second at or after `ms`.
pub(crate) fn ceil_to_second(ms: i64) -> i64 {
    ms.saturating_add(999).div_euclid(1000) * 1000
}

pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_apps_timestamp_forms() {
        assert_eq!(parse_rfc3339_ms("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T14:31:05.123Z"),
            Some(1_796_049_065_123)
        );
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T14:31:05.123456Z"),
            Some(1_796_049_065_123)
        );
        assert_eq!(
            parse_rfc3339_ms("2026-11-30T15:31:05.123+01:00"),
            Some(1_796_049_065_123)
        );
        assert_eq!(
            parse_rfc3339_ms("2000-02-29T00:00:00-00:30"),
            Some(951_784_200_000)
        );
        for bad in [
            "",
            "2026-11-30",
            "2026-13-01T00:00:00Z",
            "2026-11-30T14:31:05",
            "2026-11-30T14:31:05.Z",
            "x026-11-30T14:31:05Z",
        ] {
            assert_eq!(parse_rfc3339_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn parses_http_dates() {
        assert_eq!(
            parse_http_date_ms("Sun, 06 Nov 1994 08:49:37 GMT"),
            Some(784_111_777_000)
        );
        assert_eq!(
            parse_http_date_ms("Mon, 30 Nov 2026 14:31:05 GMT"),
            Some(1_796_049_065_000)
        );
        for bad in [
            "",
            "120",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
            "Sun, 06 Nov 1994 08:49:37 UTC",
            "Sun, 06 Foo 1994 08:49:37 GMT",
            "Sun, 06 Nov 1994 8:49:37 GMT",
        ] {
            assert_eq!(parse_http_date_ms(bad), None, "{bad}");
        }
    }

    #[test]
    fn formats_and_round_trips() {
        assert_eq!(format_utc_seconds(0), "1970-01-01 00:00:00");
        assert_eq!(format_utc_seconds(1_796_049_065_123), "2026-11-30 14:31:05");
        for ms in [0, 951_782_400_000, 1_796_049_065_000, 4_102_444_800_000] {
            let iso = format_utc_seconds(ms).replace(' ', "T") + "Z";
            assert_eq!(parse_rfc3339_ms(&iso), Some(ms));
        }
    }

    #[test]
    fn ceil_to_second_rounds_only_a_partial_second_up() {
        for (ms, up) in [
            (0, 0),
            (1, 1000),
            (999, 1000),
            (1000, 1000),
            (1001, 2000),
            (-1, 0),
            (-1000, -1000),
        ] {
            assert_eq!(ceil_to_second(ms), up, "{ms}");
        }
    }
}

//! `strftime_now(format)`, the clock function transformers gives chat templates (templates of
//! the Llama 3 family print today's date into the system prompt with it).
//!
//! Python's `datetime.now().strftime(format)` reads the machine's local time; engines run in
//! containers whose local time is UTC, so this prints UTC. The directives are Python's (C
//! locale); an unknown directive is printed as written, as glibc does.

use std::time::{SystemTime, UNIX_EPOCH};

const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// A UTC instant broken into calendar fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Civil {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    micros: u32,
    /// 0 = Monday
    weekday: u32,
    /// 1..=366
    yearday: u32,
}

impl Civil {
    fn from_unix(secs: i64, micros: u32) -> Civil {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        let jan1 = days_from_civil(year, 1, 1);
        Civil {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
            micros,
            // 1970-01-01 was a Thursday (3 with Monday = 0)
            weekday: (days + 3).rem_euclid(7) as u32,
            yearday: (days - jan1 + 1) as u32,
        }
    }
}

/// (year, month, day) of a day count since 1970-01-01 (proleptic Gregorian calendar).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Day count since 1970-01-01 of a date.
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `datetime.now().strftime(format)` in UTC.
pub(crate) fn strftime_now(format: &str) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = i64::try_from(now.as_secs()).unwrap_or(0);
    format_civil(&Civil::from_unix(secs, now.subsec_micros()), format)
}

fn format_civil(t: &Civil, format: &str) -> String {
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some(d) => directive(&mut out, t, d),
            None => out.push('%'),
        }
    }
    out
}

fn directive(out: &mut String, t: &Civil, d: char) {
    let hour12 = if t.hour % 12 == 0 { 12 } else { t.hour % 12 };
    let day_name = DAYS[t.weekday as usize % 7];
    let month_name = MONTHS[(t.month as usize + 11) % 12];
    let s = match d {
        'a' => day_name[..3].to_string(),
        'A' => day_name.to_string(),
        'b' | 'h' => month_name[..3].to_string(),
        'B' => month_name.to_string(),
        'd' => format!("{:02}", t.day),
        'e' => format!("{:2}", t.day),
        'm' => format!("{:02}", t.month),
        'y' => format!("{:02}", t.year.rem_euclid(100)),
        'Y' => t.year.to_string(),
        'H' => format!("{:02}", t.hour),
        'I' => format!("{hour12:02}"),
        'M' => format!("{:02}", t.minute),
        'S' => format!("{:02}", t.second),
        'f' => format!("{:06}", t.micros),
        'p' => if t.hour < 12 { "AM" } else { "PM" }.to_string(),
        'j' => format!("{:03}", t.yearday),
        'w' => ((t.weekday + 1) % 7).to_string(),
        'u' => (t.weekday + 1).to_string(),
        'Z' => "UTC".to_string(),
        'z' => "+0000".to_string(),
        'D' => format!("{:02}/{:02}/{:02}", t.month, t.day, t.year.rem_euclid(100)),
        'F' => format!("{}-{:02}-{:02}", t.year, t.month, t.day),
        'T' => format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second),
        'R' => format!("{:02}:{:02}", t.hour, t.minute),
        'c' => format!(
            "{} {} {:2} {:02}:{:02}:{:02} {}",
            &day_name[..3],
            &month_name[..3],
            t.day,
            t.hour,
            t.minute,
            t.second,
            t.year
        ),
        'x' => format!("{:02}/{:02}/{:02}", t.month, t.day, t.year.rem_euclid(100)),
        'X' => format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second),
        'n' => "\n".to_string(),
        't' => "\t".to_string(),
        '%' => "%".to_string(),
        other => format!("%{other}"),
    };
    out.push_str(&s);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_a_known_instant() {
        // 2024-07-26 14:05:09 UTC, a Friday, day 208 of a leap year
        let t = Civil::from_unix(1_722_002_709, 42);
        assert_eq!(
            format_civil(&t, "%d %b %Y"),
            "26 Jul 2024",
            "the Llama 3 date line"
        );
        assert_eq!(
            format_civil(&t, "%A %B %e %H:%M:%S %I%p %j %y %f %% %Q"),
            "Friday July 26 14:05:09 02PM 208 24 000042 % %Q"
        );
    }

    #[test]
    fn calendar_round_trips() {
        for days in [-719_468_i64, -1, 0, 59, 60, 365, 11_016, 19_723, 2_932_896] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}

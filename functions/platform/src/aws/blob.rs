//! How the DynamoDB store keeps its binary attributes (snapshots, event and item bodies, idempotency results, timer
//! payloads): one tag byte, then the value either as given or deflated. DynamoDB bills a write by the started KiB
//! of the item, twice inside a transaction, and a run's snapshot is rewritten by every append: the JSON it holds
//! deflates to about half, which takes a write unit or more off most appends and larger A2A task records (the AWS
//! developer guide recommends compressing large attribute values for this reason). A value is stored deflated only
//! when that is smaller; short values are not tried, since a record under 1 KiB costs one unit however small.

use miniz_oxide::deflate::compress_to_vec;
use miniz_oxide::inflate::decompress_to_vec_with_limit;

use crate::limits::MAX_BODY;

/// The value follows as given.
const PLAIN: u8 = 0;
/// The value follows as a raw DEFLATE stream (RFC 1951).
const DEFLATED: u8 = 1;
/// Shorter values are stored plain without trying: deflate rarely shortens them, and their records fit in one
/// write unit anyway.
const DEFLATE_FROM: usize = 256;
/// miniz's default level: within a few percent of the best ratio on JSON at a fraction of level 9's time.
const LEVEL: u8 = 6;

/// The stored form of `value`.
pub(super) fn pack(value: &[u8]) -> Vec<u8> {
    if value.len() >= DEFLATE_FROM {
        let deflated = compress_to_vec(value, LEVEL);
        if deflated.len() < value.len() {
            return tagged(DEFLATED, &deflated);
        }
    }
    tagged(PLAIN, value)
}

/// The value of a stored form; `None` when it is not one `pack` makes, or would inflate past `MAX_BODY` (no value
/// the store accepts is larger, so more can only be damage or a bomb).
pub(super) fn unpack(stored: &[u8]) -> Option<Vec<u8>> {
    match stored.split_first()? {
        (&PLAIN, value) => Some(value.to_vec()),
        (&DEFLATED, deflated) => decompress_to_vec_with_limit(deflated, MAX_BODY).ok(),
        _ => None,
    }
}

fn tagged(tag: u8, value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + value.len());
    out.push(tag);
    out.extend_from_slice(value);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_plain_or_deflated() {
        let json =
            br#"{"state":"fixing","attempts":[{"ci":"failed"},{"ci":"failed"},{"ci":"passed"}]}"#
                .repeat(20);
        let packed = pack(&json);
        assert_eq!(packed[0], DEFLATED);
        assert!(
            packed.len() < json.len() / 4,
            "{} of {}",
            packed.len(),
            json.len()
        );
        assert_eq!(unpack(&packed).unwrap(), json);

        for value in [&b""[..], b"{}", &[0u8, 1, 2, 255][..]] {
            let packed = pack(value);
            assert_eq!(packed[0], PLAIN);
            assert_eq!(unpack(&packed).unwrap(), value);
        }
    }

    #[test]
    fn only_values_from_the_threshold_on_are_deflated() {
        let short = b"a".repeat(DEFLATE_FROM - 1);
        assert_eq!(pack(&short)[0], PLAIN);
        assert_eq!(unpack(&pack(&short)).unwrap(), short);
        assert_eq!(pack(&b"a".repeat(DEFLATE_FROM))[0], DEFLATED);
    }

    #[test]
    fn incompressible_values_stay_plain() {
        // A xorshift stream: no repetition for deflate to find.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let packed = pack(&noise);
        assert_eq!(packed[0], PLAIN);
        assert_eq!(unpack(&packed).unwrap(), noise);
    }

    #[test]
    fn damaged_unknown_and_oversized_forms_are_refused() {
        assert_eq!(unpack(b""), None, "no tag");
        assert_eq!(unpack(b"{\"a\":1}"), None, "an untagged value");
        assert_eq!(
            unpack(&[DEFLATED, 0xff, 0xff, 0xff]),
            None,
            "not a deflate stream"
        );
        let mut truncated = pack(&b"x".repeat(10_000));
        truncated.truncate(truncated.len() / 2);
        assert_eq!(unpack(&truncated), None, "a cut deflate stream");
        // A few hundred bytes that inflate past the largest value the store accepts.
        let bomb = pack(&vec![b'a'; MAX_BODY + 1]);
        assert!(bomb.len() < 2_000);
        assert_eq!(unpack(&bomb), None);
        assert_eq!(
            unpack(&pack(&vec![b'a'; MAX_BODY])).unwrap().len(),
            MAX_BODY
        );
    }
}

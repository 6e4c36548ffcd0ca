//! The layout of the embedded kernel images, shared by `build.rs` (which
//! writes them; it includes this file with `#[path]`) and `ptx.rs` (which
//! reads them). Plain std.
//!
//! - **Container.** Every image (a PTX text or a cubin) is stored
//!   compressed, in independent zstd frames of at most [`CHUNK_BYTES`] raw
//!   bytes each, so that loading decompresses the chunks on several threads:
//!   `"P2PZ"`, the chunk count (u32 LE), then per chunk its compressed and
//!   raw byte counts (u32 LE each), then the frames in order.
//! - **PTX layout.** The byte ranges of a PTX text's top level: the `.entry`
//!   definitions by name, and everything else (the header, `.func` and
//!   `.global` definitions), which every per-family PTX module keeps.

use std::ops::Range;

/// Raw bytes per compressed chunk.
pub const CHUNK_BYTES: usize = 4 << 20;

/// The container's first four bytes.
pub const MAGIC: &[u8; 4] = b"P2PZ";

/// One chunk of a container: where its frame is in the container and where
/// its bytes go in the image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub frame: Range<usize>,
    pub raw: Range<usize>,
}

/// Packs compressed chunks (each with its raw length) into a container.
pub fn write_container(chunks: &[(Vec<u8>, usize)]) -> Vec<u8> {
    let mut out =
        Vec::with_capacity(8 + chunks.len() * 8 + chunks.iter().map(|c| c.0.len()).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(
        &u32::try_from(chunks.len())
            .expect("chunk count fits u32")
            .to_le_bytes(),
    );
    for (frame, raw) in chunks {
        out.extend_from_slice(
            &u32::try_from(frame.len())
                .expect("frame fits u32")
                .to_le_bytes(),
        );
        out.extend_from_slice(&u32::try_from(*raw).expect("chunk fits u32").to_le_bytes());
    }
    for (frame, _) in chunks {
        out.extend_from_slice(frame);
    }
    out
}

/// The chunks of a container and the image's total raw length.
pub fn parse_container(blob: &[u8]) -> Result<(Vec<Chunk>, usize), String> {
    let word = |at: usize| -> Result<usize, String> {
        blob.get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
            .ok_or_else(|| format!("container truncated at byte {at}"))
    };
    if blob.get(..4) != Some(&MAGIC[..]) {
        return Err("not a P2PZ container".into());
    }
    let n = word(4)?;
    let mut frame_at = 8usize
        .checked_add(n.checked_mul(8).ok_or("chunk count overflows")?)
        .ok_or("chunk count overflows")?;
    let mut raw_at = 0usize;
    let mut chunks = Vec::with_capacity(n.min(1 << 16));
    for i in 0..n {
        let frame = word(8 + 8 * i)?;
        let raw = word(12 + 8 * i)?;
        let frame_end = frame_at.checked_add(frame).ok_or("frame overflows")?;
        if frame_end > blob.len() {
            return Err(format!("chunk {i} runs past the container"));
        }
        chunks.push(Chunk {
            frame: frame_at..frame_end,
            raw: raw_at..raw_at + raw,
        });
        frame_at = frame_end;
        raw_at += raw;
    }
    if frame_at != blob.len() {
        return Err(format!(
            "{} bytes after the last chunk",
            blob.len() - frame_at
        ));
    }
    Ok((chunks, raw_at))
}

/// The top level of a PTX text as byte ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxLayout {
    /// Everything outside the entries, in order: the header (`.version`,
    /// `.target`, `.address_size`), `.func` and `.global` definitions.
    pub common: Vec<Range<usize>>,
    /// Each `.entry` definition (with the `// .globl` comment before it),
    /// by name, in the text's order.
    pub entries: Vec<(String, Range<usize>)>,
}

/// Splits a PTX text into its entries and the rest. An entry runs from its
/// `.entry NAME(` line (and a `// .globl NAME` comment right before it) to
/// the `}` that closes its body. Refuses a text whose braces do not
/// balance or that has no `.target` line outside the entries.
pub fn ptx_layout(text: &str) -> Result<PtxLayout, String> {
    let mut layout = PtxLayout::default();
    // Byte offset of each line start.
    let mut lines: Vec<(usize, &str)> = Vec::new();
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        lines.push((at, line));
        at += line.len();
    }
    let entry_name = |line: &str| -> Option<String> {
        let mut words = line.split_whitespace();
        let mut w = words.next()?;
        while w == ".visible" || w == ".weak" || w == ".extern" {
            w = words.next()?;
        }
        if w != ".entry" {
            return None;
        }
        let rest = &line[line.find(".entry")? + ".entry".len()..];
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '$')
            .collect();
        (!name.is_empty()).then_some(name)
    };
    fn code(line: &str) -> &str {
        line.split("//").next().unwrap_or("")
    }
    let mut common_from = 0usize;
    let mut i = 0;
    while i < lines.len() {
        let (start, line) = lines[i];
        let Some(name) = entry_name(code(line)) else {
            i += 1;
            continue;
        };
        // Take the `// .globl NAME` comment just before the entry with it.
        let mut from = start;
        if i > 0 {
            let prev = lines[i - 1].1.trim();
            if prev.starts_with("// .globl") && prev.split_whitespace().last() == Some(&name) {
                from = lines[i - 1].0;
            }
        }
        let from = from.max(common_from);
        // The body: from the first `{` to the `}` that closes it.
        let mut depth = 0i64;
        let mut opened = false;
        let mut end = None;
        let mut j = i;
        while j < lines.len() {
            let (s, l) = lines[j];
            for c in code(l).chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if depth < 0 {
                return Err(format!("entry {name}: unbalanced braces"));
            }
            if opened && depth == 0 {
                end = Some(s + l.len());
                break;
            }
            j += 1;
        }
        let end = end.ok_or_else(|| format!("entry {name}: its body never closes"))?;
        if from > common_from {
            layout.common.push(common_from..from);
        }
        layout.entries.push((name, from..end));
        common_from = end;
        i = j + 1;
    }
    if common_from < text.len() {
        layout.common.push(common_from..text.len());
    }
    let has_target = layout.common.iter().any(|r| {
        text[r.clone()]
            .lines()
            .any(|l| l.trim_start().starts_with(".target "))
    });
    if !has_target {
        return Err("no `.target` line outside the entries".into());
    }
    let mut names: Vec<&str> = layout.entries.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
        return Err(format!("entry {} is defined twice", w[0]));
    }
    Ok(layout)
}

/// FNV-1a, 64 bits: a stable content hash for build.rs's cache of
/// assembled and compressed images (not a security boundary).
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // Separate the parts, so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    const PTX: &str = "//\n// Generated\n//\n\n.version 8.7\n.target sm_90\n.address_size 64\n\n\t// .globl\tpanic\n.visible .func panic(\n\t.param .b64 p\n)\n{\n\ttrap;\n}\n\t// .globl\tk_a\n.visible .entry k_a(\n\t.param .align 8 .b8 k_a_param_0[248]\n)\n{\n\t.reg .b32 %r<3>;\n\t{ // inner scope\n\t}\n\tret;\n\n}\n\t// .globl\tk_b\n.visible .entry k_b(\n\t.param .align 8 .b8 k_b_param_0[248]\n)\n{\n\tret;\n\n}\n";

    #[test]
    fn splits_entries_from_the_rest() {
        let l = ptx_layout(PTX).expect("layout");
        let names: Vec<&str> = l.entries.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["k_a", "k_b"]);
        let a = &PTX[l.entries[0].1.clone()];
        assert!(a.starts_with("\t// .globl\tk_a\n.visible .entry k_a("));
        assert!(a.ends_with("\tret;\n\n}\n"));
        assert!(a.contains("inner scope"));
        let common: String = l.common.iter().map(|r| &PTX[r.clone()]).collect();
        assert!(common.contains(".target sm_90"));
        assert!(common.contains(".visible .func panic("));
        assert!(!common.contains(".entry"));
        // Nothing lost, nothing twice.
        let mut all: Vec<_> = l
            .common
            .iter()
            .cloned()
            .chain(l.entries.iter().map(|e| e.1.clone()))
            .collect();
        all.sort_by_key(|r| r.start);
        let mut at = 0;
        for r in all {
            assert_eq!(r.start, at);
            at = r.end;
        }
        assert_eq!(at, PTX.len());
    }

    #[test]
    fn refuses_broken_text() {
        assert!(ptx_layout(".version 8.7\n.visible .entry k(\n)\n{\n\tret;\n").is_err());
        assert!(
            ptx_layout(".version 8.7\n.visible .entry k(\n)\n{\n}\n").is_err(),
            "no .target"
        );
        assert!(ptx_layout(".target sm_90\n.entry k(\n)\n{\n}\n.entry k(\n)\n{\n}\n").is_err());
    }

    #[test]
    fn container_round_trip_and_refusals() {
        let blob = write_container(&[(vec![1, 2, 3], 10), (vec![4], 5)]);
        let (chunks, raw) = parse_container(&blob).expect("parse");
        assert_eq!(raw, 15);
        assert_eq!(
            chunks[0],
            Chunk {
                frame: 24..27,
                raw: 0..10
            }
        );
        assert_eq!(
            chunks[1],
            Chunk {
                frame: 27..28,
                raw: 10..15
            }
        );
        assert!(parse_container(&blob[..blob.len() - 1]).is_err());
        let mut longer = blob.clone();
        longer.push(0);
        assert!(parse_container(&longer).is_err());
        assert!(parse_container(b"nope").is_err());
        let mut huge = blob.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(parse_container(&huge).is_err());
    }

    #[test]
    fn fnv_separates_parts() {
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[b"x"]), fnv1a(&[b"x"]));
    }
}

//! Checks on every PTX file the build embedded (issue: the Rust-to-PTX
//! pipeline). No GPU needed; ptxas is required (scripts/setup.sh installs it).

use p2p_allreduce::ptx::{self, Entry, Family, PtxModule, MODULES};

/// One module per PTX text (modules that share a PTX, sm_103 and sm_100,
/// are checked once).
fn ptx_modules() -> Vec<&'static PtxModule> {
    let mut v: Vec<&'static PtxModule> = Vec::new();
    for m in MODULES {
        if v.iter().all(|x| x.ptx_arch != m.ptx_arch) {
            v.push(m);
        }
    }
    v
}

#[test]
fn every_default_arch_is_built() {
    let built = ptx::built_archs();
    // The default list; a user who narrows P2P_ALLREDUCE_ARCHS gets fewer.
    if std::env::var_os("P2P_ALLREDUCE_ARCHS").is_none() {
        assert_eq!(built, ["sm_120", "sm_103", "sm_100", "sm_90", "sm_80"]);
        // One PTX per major version: sm_103's SASS comes from sm_100's PTX.
        assert_eq!(
            ptx::built_ptx_archs(),
            ["sm_120", "sm_100", "sm_90", "sm_80"]
        );
    }
    assert!(!built.is_empty());
}

#[test]
fn target_matches_arch() {
    for m in MODULES {
        let target = m
            .ptx()
            .lines()
            .find(|l| l.starts_with(".target"))
            .expect(".target line");
        assert_eq!(
            target.trim(),
            format!(".target {}", m.ptx_arch),
            "{}",
            m.arch
        );
        let (major, minor) = m.compute_capability;
        assert_eq!(m.arch, format!("sm_{major}{minor}"));
        // The PTX is of the same major and no newer than the SASS.
        let ptx_sm: u32 = m.ptx_arch["sm_".len()..].parse().expect("sm_XY");
        assert_eq!(ptx_sm / 10, major, "{}: PTX {}", m.arch, m.ptx_arch);
        assert!(ptx_sm % 10 <= minor, "{}: PTX {}", m.arch, m.ptx_arch);
        // The module a device of exactly this architecture gets.
        assert_eq!(
            ptx::module_for(m.compute_capability).map(|x| x.arch),
            Some(m.arch)
        );
    }
}

#[test]
fn every_entry_is_present_with_one_launch_args_parameter() {
    for m in ptx_modules() {
        let entries = Entry::all();
        // 288 allreduce entries (6 algorithms) and 144 fused ones (3).
        assert_eq!(entries.len(), 432);
        for e in entries {
            let name = e.name();
            let text = m
                .entry_text(&name)
                .unwrap_or_else(|| panic!("{}: entry {name} missing", m.ptx_arch));
            let decl = format!(".entry {name}(");
            let at = text
                .find(&decl)
                .unwrap_or_else(|| panic!("{}: the index of {name} points elsewhere", m.ptx_arch));
            let head = &text[at..at + 200.min(text.len() - at)];
            let bytes = e.param_bytes();
            let param = format!(".param .align 8 .b8 {name}_param_0[{bytes}]");
            assert!(
                head.contains(&param),
                "{}: {name} does not take one {bytes}-byte parameter:\n{head}",
                m.ptx_arch
            );
            assert!(
                text.trim_end().ends_with('}'),
                "{}: {name} is cut",
                m.ptx_arch
            );
        }
        let count = m.ptx().matches(".entry ").count();
        assert_eq!(count, 432, "{}: unexpected extra entries", m.ptx_arch);
        assert_eq!(m.entry_names().count(), 432, "{}: index", m.ptx_arch);
    }
}

/// Each family's PTX (what the loader JIT-compiles where it loads the PTX)
/// holds exactly the family's entries, whole, after the module's header.
#[test]
fn family_ptx_holds_exactly_its_entries() {
    for m in ptx_modules() {
        let mut seen = 0;
        for f in Family::all() {
            let text = m.family_ptx(f);
            assert!(
                text.starts_with("//"),
                "{}: {f:?} lost the header",
                m.ptx_arch
            );
            assert!(text.contains(&format!("\n.target {}\n", m.ptx_arch)));
            assert_eq!(text.matches(".entry ").count(), 9, "{}: {f:?}", m.ptx_arch);
            for e in f.entries() {
                let body = m.entry_text(&e.name()).expect("entry");
                assert!(
                    text.contains(body),
                    "{}: {f:?} lacks {}",
                    m.ptx_arch,
                    e.name()
                );
                seen += 1;
            }
            // Balanced braces: every entry whole.
            assert_eq!(text.matches('{').count(), text.matches('}').count());
        }
        assert_eq!(seen, 432);
    }
}

/// ptxas takes a family's PTX as a module of its own (one family per PTX
/// architecture, a different one each: a few seconds each).
#[test]
fn family_ptx_assembles_on_its_own() {
    let Some(ptxas_bin) = ptx::PTXAS_USED else {
        panic!("the build found no ptxas: run scripts/setup.sh (installs the nvidia-cuda-nvcc-cu12 wheel under .tools/), or set P2P_ALLREDUCE_PTXAS, and rebuild");
    };
    let dir = std::env::temp_dir().join(format!("p2p-family-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let families = Family::all();
    for (i, m) in ptx_modules().into_iter().enumerate() {
        let f = families[(i * 13 + 5) % families.len()];
        let file = dir.join(format!("{}.ptx", m.ptx_arch));
        std::fs::write(&file, m.family_ptx(f)).expect("write family PTX");
        let report =
            p2p_allreduce::ptxas::assemble(std::path::Path::new(ptxas_bin), &file, m.ptx_arch)
                .unwrap_or_else(|e| panic!("{}: {f:?}: {e}", m.ptx_arch));
        let mut got: Vec<String> = report.iter().map(|k| k.entry.clone()).collect();
        got.sort();
        let mut want: Vec<String> = f.entries().iter().map(Entry::name).collect();
        want.sort();
        assert_eq!(got, want, "{}: {f:?}", m.ptx_arch);
        println!("{}: {f:?} assembled alone", m.ptx_arch);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The embedded images are compressed, and decompress to exactly what the
/// build made (its files in OUT_DIR).
#[test]
fn images_decompress_to_the_build_outputs() {
    let out = std::path::Path::new(env!("OUT_DIR"));
    for m in ptx_modules() {
        let want = std::fs::read(out.join(format!("{}.ptx", m.ptx_arch))).expect("PTX in OUT_DIR");
        assert!(
            m.ptx().as_bytes() == want.as_slice(),
            "{}: PTX differs",
            m.ptx_arch
        );
        let image = m.ptx_image();
        assert_eq!(image.len(), want.len());
        assert!(image.is_decompressed());
        assert!(
            image.compressed_len() * 8 < image.len(),
            "{}: PTX compressed only to {} of {} bytes",
            m.ptx_arch,
            image.compressed_len(),
            image.len()
        );
    }
    for m in MODULES {
        let Some(image) = m.cubin_image() else {
            continue;
        };
        let want = std::fs::read(out.join(format!("{}.cubin", m.arch))).expect("cubin in OUT_DIR");
        assert!(
            m.cubin() == Some(want.as_slice()),
            "{}: cubin differs",
            m.arch
        );
        assert!(
            image.compressed_len() * 6 < image.len(),
            "{}: cubin compressed only to {} of {} bytes",
            m.arch,
            image.compressed_len(),
            image.len()
        );
    }
}

/// First uses from several threads at once decompress once: every thread
/// gets the same bytes at the same address.
#[test]
fn concurrent_first_use_decompresses_once() {
    let m = MODULES.last().expect("a module");
    let addrs: Vec<(usize, usize)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    (
                        m.ptx().as_ptr() as usize,
                        m.cubin().map_or(0, |c| c.as_ptr() as usize),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert!(addrs.windows(2).all(|w| w[0] == w[1]), "{addrs:?}");
}

/// The body of entry `name` in `ptx`.
fn entry_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let at = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("entry {name} missing"));
    let rest = &ptx[at..];
    let end = rest.find("\n}\n").map_or(rest.len(), |e| e + 3);
    &rest[..end]
}

/// Issue 31 (racecheck): the fused push_ll split over a cluster stores into
/// other CTAs' shared memory only after a cluster barrier wait that shows
/// every CTA started. The kernel arrives as its first instruction, before
/// any access to memory (so the default release arrive orders nothing),
/// and waits later (`ClusterRow::combine`); and the cluster exchange is
/// still there. sm_80 has no clusters.
#[test]
fn fused_push_ll_arrives_at_the_cluster_barrier_before_any_memory_access() {
    for m in MODULES {
        let cluster = m.compute_capability.0 >= 9;
        for e in Entry::all().into_iter().filter(|e| {
            e.op == ptx::Op::AddRmsNorm && e.algorithm == p2p_allreduce::Algorithm::PushLl
        }) {
            let body = entry_body(m.ptx(), &e.name());
            let arrive = body.find("barrier.cluster.arrive.aligned;");
            if !cluster {
                assert!(
                    arrive.is_none(),
                    "{}: {} has a cluster barrier",
                    m.arch,
                    e.name()
                );
                continue;
            }
            let arrive =
                arrive.unwrap_or_else(|| panic!("{}: {}: no early arrive", m.arch, e.name()));
            for access in [
                "ld.global",
                "ld.volatile",
                "st.global",
                "st.volatile",
                "atom.",
                "ld.shared",
                "st.shared",
            ] {
                if let Some(first) = body.find(access) {
                    assert!(
                        arrive < first,
                        "{}: {}: {access} before the cluster arrive",
                        m.arch,
                        e.name()
                    );
                }
            }
            assert!(
                body.contains("barrier.cluster.wait"),
                "{}: {}: no wait",
                m.arch,
                e.name()
            );
            assert!(
                body.contains("st.shared::cluster"),
                "{}: {}: no exchange",
                m.arch,
                e.name()
            );
        }
    }
}

#[test]
fn no_unresolved_functions() {
    for m in ptx_modules() {
        for line in m.ptx().lines() {
            assert!(
                !line.contains(".extern .func"),
                "{}: unresolved function (a panic path or core call survived): {line}",
                m.ptx_arch
            );
        }
    }
}

#[test]
fn flags_use_system_scope_acquire_release() {
    for m in ptx_modules() {
        let text = m.ptx();
        assert!(
            text.contains("st.release.sys."),
            "{}: no st.release.sys",
            m.ptx_arch
        );
        assert!(
            text.contains("ld.acquire.sys."),
            "{}: no ld.acquire.sys",
            m.ptx_arch
        );
        assert!(
            text.contains("ld.global.v4.u32") && text.contains("st.global.v4.u32"),
            "{}: no 16-byte accesses",
            m.ptx_arch
        );
        assert!(
            !text.contains("atom.global.add") && !text.contains("atom.add"),
            "{}: RMW atomics would not work over PCIe",
            m.ptx_arch
        );
    }
}

/// The build's own `ptxas -v` run (the one whose cubins are embedded):
/// every entry of every architecture, no spills, at most 128 registers.
#[test]
fn ptxas_assembles_every_arch_without_spills() {
    let Some(ptxas_bin) = ptx::PTXAS_USED else {
        panic!("the build found no ptxas: run scripts/setup.sh (installs the nvidia-cuda-nvcc-cu12 wheel under .tools/), or set P2P_ALLREDUCE_PTXAS, and rebuild");
    };
    println!("ptxas used by the build: {ptxas_bin}");
    for m in MODULES {
        let report: Vec<_> = ptx::KERNEL_STATS
            .iter()
            .filter(|(a, _)| *a == m.arch)
            .map(|(_, k)| k)
            .collect();
        assert_eq!(
            report.len(),
            432,
            "{}: ptxas reported {} entries",
            m.arch,
            report.len()
        );
        let max_regs = report.iter().map(|k| k.registers).max().unwrap_or(0);
        println!(
            "{}: {} entries, max {} registers",
            m.arch,
            report.len(),
            max_regs
        );
        for k in &report {
            assert_eq!(
                (k.spill_store_bytes, k.spill_load_bytes, k.stack_frame_bytes),
                (0, 0, 0),
                "{}: {} spills to local memory: {k:?}",
                m.arch,
                k.entry
            );
            // 512-thread blocks (the default) need at most 128 registers
            // per thread.
            assert!(
                k.registers <= 128,
                "{}: {} needs {} registers: 512-thread blocks would not launch",
                m.arch,
                k.entry,
                k.registers
            );
        }
    }
}

/// The embedded cubins: CUDA ELF images (`EM_CUDA`) for exactly their
/// module's architecture, aligned as the driver reads them, one per module
/// where the build found ptxas.
#[test]
fn cubins_are_sass_of_their_arch() {
    assert!(
        ptx::PTXAS_USED.is_some(),
        "the build found no ptxas, so it embedded no cubins: run scripts/setup.sh and rebuild"
    );
    for m in MODULES {
        let cubin = m
            .cubin()
            .unwrap_or_else(|| panic!("{}: no cubin embedded", m.arch));
        assert_eq!(
            cubin.as_ptr() as usize % 16,
            0,
            "{}: cubin not 16-byte aligned",
            m.arch
        );
        assert_eq!(&cubin[..4], b"\x7fELF", "{}: not an ELF image", m.arch);
        assert_eq!(cubin[4], 2, "{}: not a 64-bit ELF", m.arch);
        let machine = u16::from_le_bytes([cubin[18], cubin[19]]);
        assert_eq!(
            machine, 190,
            "{}: e_machine {machine} is not EM_CUDA",
            m.arch
        );
        // e_flags name the SM: in the low byte (ELF ABI version 7) or the
        // next (version 8, which ptxas uses from sm_100 on).
        let flags = u32::from_le_bytes([cubin[48], cubin[49], cubin[50], cubin[51]]);
        let (major, minor) = m.compute_capability;
        let sm = major * 10 + minor;
        assert!(
            flags & 0xff == sm || (flags >> 8) & 0xff == sm,
            "{}: e_flags {flags:#x} do not name sm_{sm}",
            m.arch
        );
        assert!(m.runs_sass_on(m.compute_capability));
        assert!(m.runs_sass_on((major, minor + 9)));
        assert!(!m.runs_sass_on((major + 1, 0)));
        assert!(minor == 0 || !m.runs_sass_on((major, minor - 1)));
        use p2p_allreduce::ptx::{ImageChoice, PtxBecause};
        assert_eq!(
            m.cubin_for(m.compute_capability, ImageChoice::Auto),
            Ok(cubin)
        );
        assert_eq!(
            m.cubin_for(m.compute_capability, ImageChoice::Ptx),
            Err(PtxBecause::Asked)
        );
        assert_eq!(
            m.cubin_for((major + 1, 0), ImageChoice::Auto),
            Err(PtxBecause::OtherArch)
        );
    }
}

//! Checks on every PTX file the build embedded (issue: the Rust-to-PTX
//! pipeline). No GPU needed; ptxas is required (scripts/setup.sh installs it).

use p2p_allreduce::ptx::{self, Entry, MODULES};

#[test]
fn every_default_arch_is_built() {
    let built = ptx::built_archs();
    // The default list; a user who narrows P2P_ALLREDUCE_ARCHS gets fewer.
    if std::env::var_os("P2P_ALLREDUCE_ARCHS").is_none() {
        assert_eq!(built, ["sm_120", "sm_90", "sm_80"]);
    }
    assert!(!built.is_empty());
}

#[test]
fn target_matches_arch() {
    for m in MODULES {
        let target = m
            .ptx
            .lines()
            .find(|l| l.starts_with(".target"))
            .expect(".target line");
        assert_eq!(target.trim(), format!(".target {}", m.arch), "{}", m.arch);
        let (major, minor) = m.compute_capability;
        assert_eq!(m.arch, format!("sm_{major}{minor}"));
    }
}

#[test]
fn every_entry_is_present_with_one_launch_args_parameter() {
    for m in MODULES {
        let entries = Entry::all();
        // 288 allreduce entries (6 algorithms) and 144 fused ones (3).
        assert_eq!(entries.len(), 432);
        for e in entries {
            let name = e.name();
            let decl = format!(".entry {name}(");
            let at = m
                .ptx
                .find(&decl)
                .unwrap_or_else(|| panic!("{}: entry {name} missing", m.arch));
            let head = &m.ptx[at..at + 200.min(m.ptx.len() - at)];
            let bytes = e.param_bytes();
            let param = format!(".param .align 8 .b8 {name}_param_0[{bytes}]");
            assert!(
                head.contains(&param),
                "{}: {name} does not take one {bytes}-byte parameter:\n{head}",
                m.arch
            );
        }
        let count = m.ptx.matches(".entry ").count();
        assert_eq!(count, 432, "{}: unexpected extra entries", m.arch);
    }
}

#[test]
fn no_unresolved_functions() {
    for m in MODULES {
        for line in m.ptx.lines() {
            assert!(
                !line.contains(".extern .func"),
                "{}: unresolved function (a panic path or core call survived): {line}",
                m.arch
            );
        }
    }
}

#[test]
fn flags_use_system_scope_acquire_release() {
    for m in MODULES {
        assert!(
            m.ptx.contains("st.release.sys."),
            "{}: no st.release.sys",
            m.arch
        );
        assert!(
            m.ptx.contains("ld.acquire.sys."),
            "{}: no ld.acquire.sys",
            m.arch
        );
        assert!(
            m.ptx.contains("ld.global.v4.u32") && m.ptx.contains("st.global.v4.u32"),
            "{}: no 16-byte accesses",
            m.arch
        );
        assert!(
            !m.ptx.contains("atom.global.add") && !m.ptx.contains("atom.add"),
            "{}: RMW atomics would not work over PCIe",
            m.arch
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
            .cubin
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

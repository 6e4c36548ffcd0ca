fn main() {
    for m in p2p_allreduce::ptx::MODULES {
        println!("{} ({} bytes of PTX)", m.arch, m.ptx.len());
    }
}

fn main() { eprintln!("throughput benchmark: not yet written"); std::process::exit(2) }

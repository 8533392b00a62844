//! A real etcd cluster for the location-store tests (issue 34): three
//! members of Debian's etcd-server, each on an address of its own in one
//! namespace, with their data under a temporary directory; or one member
//! secured as fleets run it (client TLS with client certificates, user
//! authentication, a role confined to vnat's prefix). Members can be
//! killed one by one; `Drop` kills what is left.

use std::{
    fs::File,
    net::IpAddr,
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use super::Netns;

pub struct EtcdCluster {
    ns_path: PathBuf,
    /// The namespace's handle, for `etcdctl` there.
    fd: Arc<File>,
    members: Vec<Option<Child>>,
    /// Client URLs, one per member, in order.
    pub endpoints: Vec<String>,
    /// What `etcdctl` needs besides the endpoints: a secured cluster's CA,
    /// client certificate and root login.
    admin: Vec<String>,
}

/// The client port (etcd's own) and peer port.
const CLIENT_PORT: u16 = 2379;
const PEER_PORT: u16 = 2380;

/// A secured cluster's users: root (for `etcdctl` here) and vnat's, whose
/// role may read and write only under vnat's prefix.
const ROOT_PASSWORD: &str = "root-test-password";
pub const VNAT_USER: &str = "vnat";
pub const VNAT_PASSWORD: &str = "vnat-test-password";
/// A user with [`VNAT_PASSWORD`] and no role: it may log in, not read.
pub const ROLELESS_USER: &str = "nobody";
/// vnatd's key prefix (`vnat_daemon::daemon::etcd::PREFIX`).
const VNAT_PREFIX: &str = "/vnat/loc/";

/// How long a secured cluster's login tokens live unused (etcd's
/// `--auth-token-ttl`, 300 s by default): short, so that a test sees a
/// client whose first token expired, as a fleet's vnatd does after five
/// quiet minutes.
pub const TOKEN_TTL: Duration = Duration::from_secs(2);

/// A certificate and its key (PEM files).
#[derive(Clone, Debug)]
pub struct CertKey {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// TLS files for a secured cluster, made with `openssl` at test time into
/// a test's temporary directory: a CA, the members' certificate (their
/// addresses as IP SANs), a client certificate of that CA, and one of
/// another CA.
pub struct EtcdTls {
    /// The CA of the members' and the client's certificates (etcd's
    /// `--trusted-ca-file`, vnatd's `etcd_ca`).
    pub ca: PathBuf,
    server: CertKey,
    /// A client certificate of the CA, for etcd's `--client-cert-auth`.
    /// Its CN, `vnat-client`, names no etcd user, so a client that
    /// presents it must still log in.
    pub client: CertKey,
    /// Another CA, which did not sign the members' certificate.
    pub other_ca: PathBuf,
    /// A client certificate signed by the other CA, which the members
    /// refuse.
    pub foreign: CertKey,
}

impl EtcdTls {
    /// Make the files in `dir` for members at `members`.
    pub fn make(dir: &Path, members: &[IpAddr]) -> EtcdTls {
        let sans: Vec<String> = members.iter().map(|a| format!("IP:{a}")).collect();
        let cnf = dir.join("openssl.cnf");
        std::fs::write(
            &cnf,
            format!(
                "[req]\ndistinguished_name = dn\n[dn]\n\
                 [ca]\nbasicConstraints = critical,CA:TRUE\nkeyUsage = critical,keyCertSign,cRLSign\n\
                 subjectKeyIdentifier = hash\n\
                 [server]\nbasicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature\n\
                 extendedKeyUsage = serverAuth,clientAuth\nsubjectAltName = {}\n\
                 subjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid\n\
                 [client]\nbasicConstraints = CA:FALSE\nkeyUsage = critical,digitalSignature\n\
                 extendedKeyUsage = clientAuth\nsubjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid\n",
                sans.join(",")
            ),
        )
        .expect("writing openssl.cnf");
        let ca = |name: &str| {
            let f = CertKey {
                cert: dir.join(format!("{name}.pem")),
                key: dir.join(format!("{name}.key")),
            };
            openssl(
                &cnf,
                &["req", "-x509", "-new", "-extensions", "ca"],
                &f,
                name,
            );
            f
        };
        let (ours, theirs) = (ca("ca"), ca("other-ca"));
        let leaf = |name: &str, cn: &str, ext: &str, by: &CertKey, serial: u32| {
            let f = CertKey {
                cert: dir.join(format!("{name}.pem")),
                key: dir.join(format!("{name}.key")),
            };
            let csr = dir.join(format!("{name}.csr"));
            let csr = csr.to_str().expect("UTF-8 path");
            openssl(&cnf, &["req", "-new", "-out", csr], &f, cn);
            let out = Command::new("openssl")
                .args(["x509", "-req", "-days", "1", "-in", csr])
                .arg("-CA")
                .arg(&by.cert)
                .arg("-CAkey")
                .arg(&by.key)
                .args(["-set_serial", &serial.to_string(), "-extensions", ext])
                .arg("-extfile")
                .arg(&cnf)
                .arg("-out")
                .arg(&f.cert)
                .output()
                .expect("running openssl");
            assert!(
                out.status.success(),
                "openssl x509 -req ({name}): {}",
                String::from_utf8_lossy(&out.stderr)
            );
            f
        };
        EtcdTls {
            server: leaf("member", "etcd member", "server", &ours, 1),
            client: leaf("client", "vnat-client", "client", &ours, 2),
            foreign: leaf("foreign-client", "vnat-client", "client", &theirs, 1),
            ca: ours.cert,
            other_ca: theirs.cert,
        }
    }
}

/// `openssl req ARGS` making a new P-256 key into `f.key` (and, with
/// `-x509`, a self-signed certificate into `f.cert`), subject CN `cn`.
fn openssl(cnf: &Path, args: &[&str], f: &CertKey, cn: &str) {
    let mut cmd = Command::new("openssl");
    cmd.args(args)
        .arg("-config")
        .arg(cnf)
        .args([
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ])
        .args(["-subj", &format!("/CN={cn}")])
        .arg("-keyout")
        .arg(&f.key);
    if args.contains(&"-x509") {
        cmd.args(["-days", "1", "-out"]).arg(&f.cert);
    }
    let out = cmd.output().expect("running openssl (Debian openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn url(scheme: &str, a: &IpAddr, port: u16) -> String {
    match a {
        IpAddr::V4(_) => format!("{scheme}://{a}:{port}"),
        IpAddr::V6(_) => format!("{scheme}://[{a}]:{port}"),
    }
}

impl EtcdCluster {
    /// Start three members, at `addrs` (on `ns`, already configured), with
    /// their data and logs under `dir`, and wait until each is healthy.
    pub fn start(ns: &Netns, addrs: [IpAddr; 3], dir: &Path, token: &str) -> EtcdCluster {
        EtcdCluster::launch(ns, &addrs, dir, token, None)
    }

    /// Start one member at `addr` as a fleet secures etcd: clients only
    /// over TLS with a certificate of `tls`'s CA (`--client-cert-auth`),
    /// and user authentication on, with a root user, [`VNAT_USER`], whose
    /// role may read and write only under vnat's prefix, and
    /// [`ROLELESS_USER`]. Login tokens live [`TOKEN_TTL`].
    pub fn start_secure(
        ns: &Netns,
        addr: IpAddr,
        dir: &Path,
        token: &str,
        tls: &EtcdTls,
    ) -> EtcdCluster {
        let mut c = EtcdCluster::launch(ns, &[addr], dir, token, Some(tls));
        for args in [
            &["role", "add", "root"][..],
            &["user", "add", "root", "--new-user-password", ROOT_PASSWORD],
            &["user", "grant-role", "root", "root"],
            &["role", "add", VNAT_USER],
            &[
                "role",
                "grant-permission",
                VNAT_USER,
                "readwrite",
                "--prefix=true",
                VNAT_PREFIX,
            ],
            &[
                "user",
                "add",
                VNAT_USER,
                "--new-user-password",
                VNAT_PASSWORD,
            ],
            &["user", "grant-role", VNAT_USER, VNAT_USER],
            &[
                "user",
                "add",
                ROLELESS_USER,
                "--new-user-password",
                VNAT_PASSWORD,
            ],
            &["auth", "enable"],
        ] {
            let out = c.etcdctl(args);
            assert!(
                out.status.success(),
                "etcdctl {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        c.admin.extend([
            "--user=root".to_string(),
            format!("--password={ROOT_PASSWORD}"),
        ]);
        c
    }

    fn launch(
        ns: &Netns,
        addrs: &[IpAddr],
        dir: &Path,
        token: &str,
        tls: Option<&EtcdTls>,
    ) -> EtcdCluster {
        let scheme = if tls.is_some() { "https" } else { "http" };
        // Members talk among themselves over plain HTTP: the tests secure
        // what vnatd sees, the client side.
        let client_url = |a: &IpAddr| url(scheme, a, CLIENT_PORT);
        let peer_url = |a: &IpAddr| url("http", a, PEER_PORT);
        let initial: Vec<String> = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| format!("m{i}={}", peer_url(a)))
            .collect();
        let initial = initial.join(",");
        let mut members = Vec::new();
        for (i, a) in addrs.iter().enumerate() {
            let data = dir.join(format!("etcd-m{i}"));
            let log =
                std::fs::File::create(dir.join(format!("etcd-m{i}.log"))).expect("etcd log file");
            let mut cmd = ns.cmd("etcd");
            cmd.args(["--name", &format!("m{i}")])
                .arg("--data-dir")
                .arg(&data)
                .args(["--listen-client-urls", &client_url(a)])
                .args(["--advertise-client-urls", &client_url(a)])
                .args(["--listen-peer-urls", &peer_url(a)])
                .args(["--initial-advertise-peer-urls", &peer_url(a)])
                .args(["--initial-cluster", &initial])
                .args(["--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", token])
                // Elections in well under a second, as on a LAN.
                .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
                .args(["--logger", "zap", "--log-level", "warn"]);
            if let Some(t) = tls {
                cmd.arg("--cert-file")
                    .arg(&t.server.cert)
                    .arg("--key-file")
                    .arg(&t.server.key)
                    .arg("--trusted-ca-file")
                    .arg(&t.ca)
                    .arg("--client-cert-auth")
                    .args(["--auth-token-ttl", &TOKEN_TTL.as_secs().to_string()]);
            }
            let child = cmd
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("starting etcd (Debian etcd-server; cargo xtask prereq installs it)");
            members.push(Some(child));
        }
        let admin = match tls {
            Some(t) => vec![
                format!("--cacert={}", t.ca.display()),
                format!("--cert={}", t.client.cert.display()),
                format!("--key={}", t.client.key.display()),
            ],
            None => Vec::new(),
        };
        let c = EtcdCluster {
            ns_path: ns.path(),
            members,
            endpoints: addrs.iter().map(client_url).collect(),
            fd: Arc::clone(&ns.fd),
            admin,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = c.etcdctl(&["endpoint", "health"]);
            if out.status.success() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the etcd cluster did not become healthy within 30 s: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        c
    }

    /// `etcdctl` against every live member.
    pub fn etcdctl(&self, args: &[&str]) -> std::process::Output {
        let eps: Vec<&str> = self
            .endpoints
            .iter()
            .zip(&self.members)
            .filter(|(_, m)| m.is_some())
            .map(|(e, _)| e.as_str())
            .collect();
        cmd_in(&self.fd, "etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", eps.join(",")))
            .args(["--command-timeout=5s"])
            .args(&self.admin)
            .args(args)
            .output()
            .expect("running etcdctl (Debian etcd-client)")
    }

    /// The keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let out = self.etcdctl(&["get", "--prefix", "--keys-only", prefix]);
        assert!(
            out.status.success(),
            "etcdctl get: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Kill member `i` (SIGKILL, as a crashed machine).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kill every member.
    pub fn kill_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    /// The `--location-store etcd --etcd-endpoint ...` flags for vnatd.
    pub fn vnatd_flags(&self) -> Vec<String> {
        let mut f = vec!["--location-store".to_string(), "etcd".to_string()];
        for e in &self.endpoints {
            f.push("--etcd-endpoint".into());
            f.push(e.clone());
        }
        f
    }

    /// vnatd's config file for this cluster, as a user writes it: TLS with
    /// the CA `ca` and the client certificate `client`, and the login of
    /// `user` with the password in `password_file`.
    pub fn vnatd_toml(
        &self,
        ca: &Path,
        client: &CertKey,
        user: &str,
        password_file: &Path,
    ) -> String {
        let quoted: Vec<String> = self.endpoints.iter().map(|e| format!("{e:?}")).collect();
        format!(
            "location_store = \"etcd\"\netcd_endpoints = [{}]\netcd_ca = {:?}\n\
             etcd_cert = {:?}\netcd_key = {:?}\netcd_user = {user:?}\netcd_password_file = {:?}\n",
            quoted.join(", "),
            ca.display().to_string(),
            client.cert.display().to_string(),
            client.key.display().to_string(),
            password_file.display().to_string(),
        )
    }

    pub fn netns_path(&self) -> &Path {
        &self.ns_path
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// `program` in the namespace of `fd` (as `Netns::cmd`).
fn cmd_in(fd: &Arc<File>, program: &str) -> Command {
    let mut cmd = Command::new(program);
    let fd = Arc::clone(fd);
    // SAFETY: the hook only calls setns(2), which is async-signal-safe,
    // and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

//! Where location records are kept (issue 34): the store every vnatd
//! embeds (the default), or etcd, which fleets already run replicated.
//! The keys `location_store`, `etcd_endpoints`, `etcd_ca`, `etcd_cert`,
//! `etcd_key`, `etcd_user` and `etcd_password_file`, checked here so that
//! a bad combination is refused at start in one sentence.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{ConfigError, FileConfig};

/// `location_store`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// This vnatd's own store (it answers other vnatd's STOREs and
    /// LOOKUPs), kept across restarts in the state directory.
    #[default]
    Embedded,
    /// etcd's v3 API, besides the embedded store.
    Etcd,
}

/// How vnatd reaches etcd.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EtcdSettings {
    /// `http://host:port` or `https://host:port`, each a member's client URL.
    pub endpoints: Vec<String>,
    /// TLS: the CA that signed the members' certificates, and this host's
    /// client certificate and key (both or neither).
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// etcd's user authentication; the password is read from the file at
    /// start, never written in the config.
    pub user: Option<String>,
    pub password_file: Option<PathBuf>,
}

impl EtcdSettings {
    /// Whether it talks TLS.
    pub fn tls(&self) -> bool {
        self.ca.is_some() || self.endpoints.iter().any(|e| e.starts_with("https://"))
    }
}

/// The store as resolved: `None` is the embedded one alone.
pub type StoreSetting = Option<EtcdSettings>;

/// One sentence for `vnatd --check` and the start-up log.
pub fn describe(s: &StoreSetting) -> String {
    match s {
        None => "embedded (records kept in the state directory, locations.json)".into(),
        Some(e) => format!(
            "etcd at {}{}{}",
            e.endpoints.join(", "),
            if e.tls() { ", TLS" } else { "" },
            e.user
                .as_ref()
                .map(|u| format!(", user {u}"))
                .unwrap_or_default()
        ),
    }
}

/// The etcd options that only make sense with `location_store = "etcd"`.
fn etcd_keys_given(file: &FileConfig) -> Option<&'static str> {
    [
        ("etcd_endpoints", file.etcd_endpoints.is_some()),
        ("etcd_ca", file.etcd_ca.is_some()),
        ("etcd_cert", file.etcd_cert.is_some()),
        ("etcd_key", file.etcd_key.is_some()),
        ("etcd_user", file.etcd_user.is_some()),
        ("etcd_password_file", file.etcd_password_file.is_some()),
    ]
    .into_iter()
    .find(|(_, given)| *given)
    .map(|(k, _)| k)
}

/// Check the file's store keys (paths absolute, endpoints URLs).
pub(super) fn check_file(path: &Path, file: &FileConfig) -> Result<(), ConfigError> {
    for (key, v) in [
        ("etcd_ca", &file.etcd_ca),
        ("etcd_cert", &file.etcd_cert),
        ("etcd_key", &file.etcd_key),
        ("etcd_password_file", &file.etcd_password_file),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_absolute()) {
            return Err(ConfigError::RelativePath {
                file: path.to_path_buf(),
                key,
                value: v.clone(),
            });
        }
    }
    for e in file.etcd_endpoints.iter().flatten() {
        check_endpoint(e)?;
    }
    Ok(())
}

fn check_endpoint(e: &str) -> Result<(), ConfigError> {
    let rest = e
        .strip_prefix("http://")
        .or_else(|| e.strip_prefix("https://"));
    let ok = rest.is_some_and(|r| {
        let hostport = r.trim_end_matches('/');
        !hostport.is_empty()
            && !hostport.contains('/')
            && hostport
                .rsplit_once(':')
                .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p != 0))
    });
    if ok {
        Ok(())
    } else {
        Err(ConfigError::EtcdEndpoint {
            value: e.to_string(),
        })
    }
}

/// Resolve the store from the flags over the file.
pub(super) fn resolve(
    kind_flag: Option<StoreKind>,
    endpoint_flags: Vec<String>,
    file: &FileConfig,
) -> Result<StoreSetting, ConfigError> {
    let kind = kind_flag.or(file.location_store).unwrap_or_default();
    let endpoints = if endpoint_flags.is_empty() {
        file.etcd_endpoints.clone().unwrap_or_default()
    } else {
        for e in &endpoint_flags {
            check_endpoint(e)?;
        }
        endpoint_flags
    };
    if kind == StoreKind::Embedded {
        return match etcd_keys_given(file) {
            Some(key) => Err(ConfigError::EtcdKeyWithoutEtcd { key }),
            None => Ok(None),
        };
    }
    if endpoints.is_empty() {
        return Err(ConfigError::EtcdNoEndpoints);
    }
    if file.etcd_cert.is_some() != file.etcd_key.is_some() {
        return Err(ConfigError::EtcdCertKeyPair);
    }
    if file.etcd_user.is_some() != file.etcd_password_file.is_some() {
        return Err(ConfigError::EtcdUserPassword);
    }
    let s = EtcdSettings {
        endpoints,
        ca: file.etcd_ca.clone(),
        cert: file.etcd_cert.clone(),
        key: file.etcd_key.clone(),
        user: file.etcd_user.clone(),
        password_file: file.etcd_password_file.clone(),
    };
    if (s.ca.is_some() || s.cert.is_some()) && s.endpoints.iter().any(|e| e.starts_with("http://"))
    {
        return Err(ConfigError::EtcdTlsOverHttp);
    }
    Ok(Some(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<StoreSetting, ConfigError> {
        let f = super::super::parse_file(Path::new("/etc/vnat/vnatd.toml"), text)?;
        resolve(None, Vec::new(), &f)
    }

    #[test]
    fn embedded_is_the_default_and_etcd_needs_endpoints() {
        assert_eq!(parse("").expect("empty file"), None);
        assert!(matches!(
            parse("location_store = \"etcd\"\n"),
            Err(ConfigError::EtcdNoEndpoints)
        ));
        let s = parse(
            "location_store = \"etcd\"\netcd_endpoints = [\"https://10.0.0.1:2379\", \"https://10.0.0.2:2379\"]\n\
             etcd_ca = \"/etc/vnat/etcd-ca.pem\"\netcd_user = \"vnat\"\netcd_password_file = \"/etc/vnat/etcd-password\"\n",
        )
        .expect("a full etcd config")
        .expect("etcd");
        assert!(s.tls());
        assert_eq!(
            describe(&Some(s)),
            "etcd at https://10.0.0.1:2379, https://10.0.0.2:2379, TLS, user vnat"
        );
    }

    #[test]
    fn bad_store_configs_are_refused_with_one_sentence() {
        for (text, want) in [
            ("etcd_endpoints = [\"http://10.0.0.1:2379\"]\n", "location_store = \"etcd\""),
            (
                "location_store = \"etcd\"\netcd_endpoints = [\"10.0.0.1:2379\"]\n",
                "http://HOST:PORT",
            ),
            (
                "location_store = \"etcd\"\netcd_endpoints = [\"http://a:2379\"]\netcd_cert = \"/c.pem\"\n",
                "both",
            ),
            (
                "location_store = \"etcd\"\netcd_endpoints = [\"http://a:2379\"]\netcd_user = \"u\"\n",
                "etcd_password_file",
            ),
            (
                "location_store = \"etcd\"\netcd_endpoints = [\"http://a:2379\"]\netcd_ca = \"/ca.pem\"\n",
                "https://",
            ),
            (
                "location_store = \"etcd\"\netcd_endpoints = [\"http://a:2379\"]\netcd_password_file = \"pw\"\n",
                "absolute",
            ),
            ("location_store = \"zookeeper\"\n", "unknown variant"),
        ] {
            let e = parse(text).expect_err(text).to_string();
            assert!(e.contains(want), "{text}: {e}");
            assert!(!e.contains('\n'), "one sentence: {e}");
        }
    }
}

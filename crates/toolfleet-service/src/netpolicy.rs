//! The SSRF policy: which URLs and addresses the web worker (and the
//! orchestrator's webhook sinks) may reach.
//!
//! Every outbound request passes two gates. [`NetPolicy::check_url`] is
//! syntactic and runs before anything else (it is also the worker's
//! `before_call` hook for `read_page`): only `http` and `https`, only
//! allowed ports, no credentials, no internationalised host unless allowed,
//! and a host that is an IP literal — in any of the numeric spellings the
//! URL standard accepts (`0x7f000001`, `2130706433`, `0177.0.0.1`,
//! `127.1`), which the `url` crate normalises to the address — checked as
//! an address. [`NetPolicy::check_ip`] is the address gate, applied to
//! every address a name resolves to, before any connection: only global
//! unicast addresses pass, unless the operator allowed the host or a CIDR.
//!
//! A refusal is a [`Blocked`]: answered `blocked` with its reason, never
//! `error`.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use url::{Host, Url};

/// Why a URL or address is refused. The message says why, for the model
/// and the operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Blocked(pub String);

/// The longest URL read.
pub const MAX_URL_CHARS: usize = 2048;

/// The operator's policy: the gates' exceptions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetPolicy {
    /// Ports a URL may name (its scheme's default when it names none).
    pub allowed_ports: Vec<u16>,
    /// Every port passes (the orchestrator's webhook sinks: a receiver's
    /// port is its own; the address gate guards the network).
    pub any_port: bool,
    /// Host names (lower case, exact) whose addresses are not checked:
    /// the operator vouches for them. `host:port` also allows that port.
    pub allow_hosts: Vec<String>,
    /// Networks whose addresses pass although they are not global.
    pub allow_cidrs: Vec<IpNet>,
    /// Whether internationalised host names (`xn--` labels, non-ASCII)
    /// are read; off by default (look-alike hosts).
    pub allow_idn: bool,
}

impl Default for NetPolicy {
    fn default() -> Self {
        Self {
            allowed_ports: vec![80, 443],
            any_port: false,
            allow_hosts: Vec::new(),
            allow_cidrs: Vec::new(),
            allow_idn: false,
        }
    }
}

/// A URL that passed [`NetPolicy::check_url`]: what to connect to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The URL without its fragment.
    pub url: Url,
    /// The host as connected to: a name to resolve, or an address.
    pub host: TargetHost,
    pub port: u16,
    /// The operator allowed this host by name: its addresses are not
    /// checked.
    pub host_allowed: bool,
}

/// A [`Target`]'s host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TargetHost {
    Name(String),
    Ip(IpAddr),
}

impl NetPolicy {
    /// The syntactic gate: parses `raw` and refuses what may not be read
    /// whatever it resolves to.
    ///
    /// # Errors
    ///
    /// [`Blocked`] with the reason.
    pub fn check_url(&self, raw: &str) -> Result<Target, Blocked> {
        if raw.len() > MAX_URL_CHARS {
            return Err(Blocked(format!(
                "the URL is longer than {MAX_URL_CHARS} characters"
            )));
        }
        let mut url = Url::parse(raw.trim())
            .map_err(|e| Blocked(format!("not a URL that can be read ({e})")))?;
        self.check_parsed(&mut url, raw)
    }

    /// [`NetPolicy::check_url`] for an already parsed URL (a redirect's
    /// `Location` joined to the page it came from).
    ///
    /// # Errors
    ///
    /// [`Blocked`] with the reason.
    pub fn check(&self, url: &Url) -> Result<Target, Blocked> {
        let mut url = url.clone();
        let raw = url.as_str().to_owned();
        self.check_parsed(&mut url, &raw)
    }

    fn check_parsed(&self, url: &mut Url, raw: &str) -> Result<Target, Blocked> {
        match url.scheme() {
            "http" | "https" => {}
            other => {
                return Err(Blocked(format!(
                    "only http and https URLs are read, not {other}:"
                )));
            }
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(Blocked(
                "URLs with credentials (user:password@) are not read".into(),
            ));
        }
        let port = url
            .port_or_known_default()
            .ok_or_else(|| Blocked("the URL has no port".into()))?;
        url.set_fragment(None);
        let (host, name) = match url.host() {
            None => return Err(Blocked("the URL has no host".into())),
            Some(Host::Ipv4(ip)) => (TargetHost::Ip(IpAddr::V4(ip)), ip.to_string()),
            Some(Host::Ipv6(ip)) => (TargetHost::Ip(IpAddr::V6(ip)), format!("[{ip}]")),
            Some(Host::Domain(domain)) => {
                let domain = domain.trim_end_matches('.').to_ascii_lowercase();
                let host_part = raw
                    .split_once("://")
                    .map_or(raw, |(_, rest)| rest)
                    .split(['/', '?', '#'])
                    .next()
                    .unwrap_or_default();
                let idn = !host_part.is_ascii()
                    || domain.split('.').any(|label| label.starts_with("xn--"));
                if idn && !self.allow_idn {
                    return Err(Blocked(format!(
                        "internationalised host names are not read ({domain}): look-alike \
                         hosts are a phishing and SSRF risk; an operator can allow them"
                    )));
                }
                if domain.is_empty() {
                    return Err(Blocked("the URL has no host".into()));
                }
                (TargetHost::Name(domain.clone()), domain)
            }
        };
        let with_port = format!("{name}:{port}");
        let port_allowed = self.any_port
            || self.allowed_ports.contains(&port)
            || self.allow_hosts.contains(&with_port);
        if !port_allowed {
            return Err(Blocked(format!(
                "port {port} is not allowed (allowed: {})",
                self.allowed_ports
                    .iter()
                    .map(u16::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let host_allowed =
            self.allow_hosts.contains(&name) || self.allow_hosts.contains(&with_port);
        if let TargetHost::Ip(ip) = host
            && !host_allowed
        {
            self.check_ip(ip)?;
        }
        Ok(Target {
            url: url.clone(),
            host,
            port,
            host_allowed,
        })
    }

    /// The address gate: `ip` passes when it is global unicast or in an
    /// allowed CIDR.
    ///
    /// # Errors
    ///
    /// [`Blocked`] naming the kind of address.
    pub fn check_ip(&self, ip: IpAddr) -> Result<(), Blocked> {
        if self.allow_cidrs.iter().any(|net| net.contains(&ip)) {
            return Ok(());
        }
        match non_global(ip) {
            None => Ok(()),
            Some(kind) => Err(Blocked(format!(
                "{ip} is {kind}: only public internet addresses are read"
            ))),
        }
    }
}

/// What kind of non-global address `ip` is, or `None` when it is global
/// unicast.
#[must_use]
pub fn non_global(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => non_global_v4(v4),
        IpAddr::V6(v6) => non_global_v6(v6),
    }
}

fn in_v4(ip: Ipv4Addr, net: [u8; 4], prefix: u32) -> bool {
    let mask = if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    };
    (u32::from(ip) & mask) == (u32::from(Ipv4Addr::from(net)) & mask)
}

fn non_global_v4(ip: Ipv4Addr) -> Option<&'static str> {
    const RANGES: &[([u8; 4], u32, &str)] = &[
        (
            [0, 0, 0, 0],
            8,
            "in 0.0.0.0/8 (this network; 0.0.0.0 means any local address)",
        ),
        ([10, 0, 0, 0], 8, "a private address (10.0.0.0/8)"),
        (
            [100, 64, 0, 0],
            10,
            "a carrier-grade NAT address (100.64.0.0/10)",
        ),
        ([127, 0, 0, 0], 8, "a loopback address"),
        (
            [169, 254, 0, 0],
            16,
            "a link-local address (169.254.0.0/16, where cloud metadata services live)",
        ),
        ([172, 16, 0, 0], 12, "a private address (172.16.0.0/12)"),
        (
            [192, 0, 0, 0],
            24,
            "an IETF protocol address (192.0.0.0/24)",
        ),
        ([192, 0, 2, 0], 24, "a documentation address (192.0.2.0/24)"),
        (
            [192, 88, 99, 0],
            24,
            "a 6to4 relay address (192.88.99.0/24)",
        ),
        ([192, 168, 0, 0], 16, "a private address (192.168.0.0/16)"),
        (
            [198, 18, 0, 0],
            15,
            "a benchmarking address (198.18.0.0/15)",
        ),
        (
            [198, 51, 100, 0],
            24,
            "a documentation address (198.51.100.0/24)",
        ),
        (
            [203, 0, 113, 0],
            24,
            "a documentation address (203.0.113.0/24)",
        ),
        ([224, 0, 0, 0], 4, "a multicast address"),
        ([255, 255, 255, 255], 32, "the broadcast address"),
        ([240, 0, 0, 0], 4, "a reserved address (240.0.0.0/4)"),
    ];
    RANGES
        .iter()
        .find(|(net, prefix, _)| in_v4(ip, *net, *prefix))
        .map(|(_, _, kind)| *kind)
}

fn non_global_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if ip.is_unspecified() {
        return Some("the unspecified address");
    }
    if ip.is_loopback() {
        return Some("a loopback address");
    }
    // ::ffff:a.b.c.d and the deprecated ::a.b.c.d carry IPv4 addresses a
    // dual-stack socket would reach: never read through them.
    if s[..5] == [0; 5] && (s[5] == 0xffff || s[5] == 0) {
        return Some("an IPv4-mapped or IPv4-compatible IPv6 address");
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        // NAT64: the embedded IPv4 address decides.
        let v4 = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
        return non_global_v4(v4).map(|_| "a NAT64 address of a non-public IPv4 address");
    }
    if s[0] == 0x64 && s[1] == 0xff9b && s[2] == 1 {
        return Some("a local-use NAT64 address (64:ff9b:1::/48)");
    }
    let first = s[0];
    let kind = if first & 0xff00 == 0xff00 {
        "a multicast address"
    } else if first & 0xffc0 == 0xfe80 {
        "a link-local address (fe80::/10)"
    } else if first & 0xffc0 == 0xfec0 {
        "a site-local address (fec0::/10)"
    } else if first & 0xfe00 == 0xfc00 {
        "a unique local address (fc00::/7)"
    } else if first == 0x2001 && s[1] == 0 {
        "a Teredo address (2001::/32), which tunnels to an IPv4 address"
    } else if first == 0x2001 && s[1] == 0x0db8 {
        "a documentation address (2001:db8::/32)"
    } else if first == 0x2001 && s[1] < 0x0200 {
        "an IETF protocol address (2001::/23)"
    } else if first == 0x2002 {
        "a 6to4 address (2002::/16), which tunnels to an IPv4 address"
    } else if first == 0x3fff && s[1] < 0x1000 {
        "a documentation address (3fff::/20)"
    } else if first & 0xe000 != 0x2000 {
        // Only 2000::/3 is global unicast.
        "not a global unicast address"
    } else {
        return None;
    };
    Some(kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocked(policy: &NetPolicy, url: &str) -> String {
        match policy.check_url(url) {
            Err(Blocked(reason)) => reason,
            Ok(t) => panic!("{url} passed as {t:?}"),
        }
    }

    #[test]
    fn classic_vectors_are_refused_by_address() {
        let policy = NetPolicy::default();
        for (url, why) in [
            ("http://127.0.0.1/", "loopback"),
            ("http://[::1]/", "loopback"),
            ("http://0x7f000001/", "127.0.0.1 is a loopback"),
            ("http://2130706433/", "127.0.0.1 is a loopback"),
            ("http://0177.0.0.1/", "127.0.0.1 is a loopback"),
            ("http://127.1/", "127.0.0.1 is a loopback"),
            ("http://[::ffff:127.0.0.1]/", "IPv4-mapped"),
            ("http://[::ffff:192.168.2.1]/", "IPv4-mapped"),
            ("http://[64:ff9b::192.168.2.1]/", "NAT64"),
            ("http://[2001:0:4136:e378:8000:63bf:3f57:fdf2]/", "Teredo"),
            ("http://[2002:c0a8:ffff::]/", "6to4"),
            ("http://[fec0::1]/", "site-local"),
            ("http://[fd00::1]/", "unique local"),
            ("http://[fe80::1]/", "link-local"),
            ("http://[ff02::1]/", "multicast"),
            ("http://[::]/", "unspecified"),
            ("http://100.64.0.0/", "carrier-grade NAT"),
            ("http://0.1.1.1/", "0.0.0.0/8"),
            ("http://0.0.0.0/", "0.0.0.0/8"),
            ("http://255.255.255.255/", "broadcast"),
            ("http://169.254.169.254/latest/meta-data/", "cloud metadata"),
            ("http://10.1.2.3/", "private"),
            ("http://172.31.0.1/", "private"),
            ("http://192.168.0.1/", "private"),
            ("http://224.0.0.1/", "multicast"),
            ("http://240.0.0.1/", "reserved"),
            ("http://198.18.0.1/", "benchmarking"),
            ("http://[2001:db8::1]/", "documentation"),
        ] {
            let reason = blocked(&policy, url);
            assert!(reason.contains(why), "{url}: {reason}");
        }
    }

    #[test]
    fn schemes_credentials_ports_and_idn_are_refused() {
        let policy = NetPolicy::default();
        for (url, why) in [
            ("file:///etc/passwd", "not file:"),
            ("data:text/html,<h1>x</h1>", "not data:"),
            ("ftp://example.com/", "not ftp:"),
            ("javascript:alert(1)", "not javascript:"),
            ("http://user:pw@example.com/", "credentials"),
            ("http://user@example.com/", "credentials"),
            ("http://example.com:8080/", "port 8080 is not allowed"),
            ("http://example.com:22/", "port 22"),
            ("http://bücher.example/", "internationalised"),
            ("http://xn--bcher-kva.example/", "internationalised"),
            ("not a url", "not a URL"),
        ] {
            let reason = blocked(&policy, url);
            assert!(reason.contains(why), "{url}: {reason}");
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_CHARS));
        assert!(blocked(&policy, &long).contains("longer than"));
    }

    #[test]
    fn public_urls_pass_and_the_fragment_goes() {
        let policy = NetPolicy::default();
        let t = policy
            .check_url("https://Example.COM./a/b?c=d#frag")
            .unwrap();
        assert_eq!(t.host, TargetHost::Name("example.com".into()));
        assert_eq!(t.port, 443);
        assert_eq!(t.url.as_str(), "https://example.com./a/b?c=d");
        assert!(!t.host_allowed);
        let t = policy.check_url("http://93.184.216.34/").unwrap();
        assert_eq!(t.host, TargetHost::Ip("93.184.216.34".parse().unwrap()));
        let t = policy.check_url("http://[2606:2800:220:1::]/").unwrap();
        assert!(matches!(t.host, TargetHost::Ip(IpAddr::V6(_))));
        // NAT64 of a public address is public.
        assert!(policy.check_url("http://[64:ff9b::808:808]/").is_ok());
    }

    #[test]
    fn the_operator_allows_hosts_cidrs_ports_and_idn() {
        let policy = NetPolicy {
            allowed_ports: vec![80, 443],
            any_port: false,
            allow_hosts: vec!["intranet.local:8080".into(), "127.0.0.1".into()],
            allow_cidrs: vec!["10.9.0.0/16".parse().unwrap()],
            allow_idn: true,
        };
        let t = policy.check_url("http://intranet.local:8080/").unwrap();
        assert!(t.host_allowed);
        assert!(policy.check_url("http://127.0.0.1/").unwrap().host_allowed);
        assert!(blocked(&policy, "http://127.0.0.1:8080/").contains("port 8080"));
        assert!(blocked(&policy, "http://127.0.0.2/").contains("loopback"));
        assert!(policy.check_url("http://10.9.1.1/").is_ok());
        assert!(blocked(&policy, "http://10.8.1.1/").contains("private"));
        assert!(policy.check_url("http://bücher.example/").is_ok());
        assert!(policy.check_ip("10.9.200.1".parse().unwrap()).is_ok());
    }

    #[test]
    fn global_addresses_pass_the_address_gate() {
        for ip in [
            "8.8.8.8",
            "1.1.1.1",
            "2606:4700:4700::1111",
            "2a00:1450:4001::",
        ] {
            assert_eq!(non_global(ip.parse().unwrap()), None, "{ip}");
        }
        for ip in ["::ffff:8.8.8.8", "2001::1", "100::1", "3fff::1", "4000::1"] {
            assert!(non_global(ip.parse().unwrap()).is_some(), "{ip}");
        }
    }
}

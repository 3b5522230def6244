//! `ADDR:PORT` as given to `--listen` and `--connect`.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::str::FromStr;

/// A host and a TCP port: `10.0.0.2:29500`, `[fe80::1]:29500`, `node7.cluster:29500`.
///
/// Parsed by [`FromStr`]; a host name is checked for shape here and resolved only when used.
/// Port 0 parses (listening on it picks a free port) but cannot be connected to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    host: Host,
    port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Host {
    Ip(IpAddr),
    Name(String),
}

impl Endpoint {
    /// The endpoint of a socket address.
    pub fn from_socket_addr(addr: SocketAddr) -> Endpoint {
        Endpoint {
            host: Host::Ip(addr.ip()),
            port: addr.port(),
        }
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The addresses the host resolves to, in the resolver's order. A host name is looked
    /// up by the system resolver, which blocks for as long as it takes.
    pub fn resolve(&self) -> std::io::Result<Vec<SocketAddr>> {
        match &self.host {
            Host::Ip(ip) => Ok(vec![SocketAddr::new(*ip, self.port)]),
            Host::Name(name) => {
                let addrs: Vec<SocketAddr> =
                    (name.as_str(), self.port).to_socket_addrs()?.collect();
                if addrs.is_empty() {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "the name has no addresses",
                    ));
                }
                Ok(addrs)
            }
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
            Host::Ip(IpAddr::V4(ip)) => write!(f, "{ip}:{}", self.port),
            Host::Name(name) => write!(f, "{name}:{}", self.port),
        }
    }
}

/// Why an `ADDR:PORT` string was refused. The `Display` quotes the input and says what a good
/// one looks like.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointError {
    /// The string given.
    pub input: String,
    /// What is wrong with it.
    pub problem: EndpointProblem,
}

/// What is wrong with an `ADDR:PORT` string.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndpointProblem {
    /// No `:PORT` at the end.
    MissingPort,
    /// The port is not a number from 0 to 65535.
    BadPort,
    /// Nothing before `:PORT`.
    EmptyHost,
    /// An IPv6 address without brackets (`::1:29500`).
    Ipv6NeedsBrackets,
    /// `[...]` that is not an IPv6 address, or no `]`.
    BadBracketedAddress,
    /// Looks like an IPv4 address (digits and dots only) but is not one.
    BadIpv4,
    /// Not a valid host name (labels of letters, digits and `-`, at most 253 characters).
    BadHostName,
}

impl fmt::Display for EndpointError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let input = &self.input;
        let why = match self.problem {
            EndpointProblem::MissingPort => "no port: give ADDR:PORT",
            EndpointProblem::BadPort => "the port is not a number from 0 to 65535",
            EndpointProblem::EmptyHost => {
                "no host before the port (to listen on every interface, use 0.0.0.0:PORT or [::]:PORT)"
            }
            EndpointProblem::Ipv6NeedsBrackets => {
                "an IPv6 address needs brackets around it, as in [::1]:29500"
            }
            EndpointProblem::BadBracketedAddress => {
                "brackets must hold an IPv6 address and be followed by :PORT, as in [fe80::1]:29500"
            }
            EndpointProblem::BadIpv4 => "not a valid IPv4 address",
            EndpointProblem::BadHostName => {
                "not a valid host name (letters, digits, '-' and '.', at most 253 characters)"
            }
        };
        write!(
            f,
            "bad address {input:?}: {why}; expected ADDR:PORT, e.g. 10.0.0.2:29500, \
             [fe80::1]:29500 or node7:29500"
        )
    }
}

impl std::error::Error for EndpointError {}

impl FromStr for Endpoint {
    type Err = EndpointError;

    fn from_str(input: &str) -> Result<Endpoint, EndpointError> {
        let fail = |problem| EndpointError {
            input: input.to_string(),
            problem,
        };
        let (host, port) = if let Some(rest) = input.strip_prefix('[') {
            let (inside, after) = rest
                .split_once(']')
                .ok_or(fail(EndpointProblem::BadBracketedAddress))?;
            let ip: Ipv6Addr = inside
                .parse()
                .map_err(|_| fail(EndpointProblem::BadBracketedAddress))?;
            let port = match after.strip_prefix(':') {
                Some(port) => port,
                None if after.is_empty() => return Err(fail(EndpointProblem::MissingPort)),
                None => return Err(fail(EndpointProblem::BadBracketedAddress)),
            };
            (Host::Ip(IpAddr::V6(ip)), port)
        } else {
            let (host, port) = input
                .rsplit_once(':')
                .ok_or(fail(EndpointProblem::MissingPort))?;
            if host.contains(':') {
                return Err(fail(EndpointProblem::Ipv6NeedsBrackets));
            }
            if host.is_empty() {
                return Err(fail(EndpointProblem::EmptyHost));
            }
            (parse_host(host).map_err(fail)?, port)
        };
        if port.is_empty() {
            return Err(fail(EndpointProblem::MissingPort));
        }
        // u16's parser takes a leading '+'; a port is digits only.
        if !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(fail(EndpointProblem::BadPort));
        }
        let port: u16 = port.parse().map_err(|_| fail(EndpointProblem::BadPort))?;
        Ok(Endpoint { host, port })
    }
}

fn parse_host(host: &str) -> Result<Host, EndpointProblem> {
    if host.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        // Digits and dots only: an IPv4 address or nothing. Never hand "1.2.3" to the
        // resolver, which would read it the inet_aton way as 1.2.0.3.
        return host
            .parse::<Ipv4Addr>()
            .map(|ip| Host::Ip(IpAddr::V4(ip)))
            .map_err(|_| EndpointProblem::BadIpv4);
    }
    let name = host.strip_suffix('.').unwrap_or(host);
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if name.len() > 253 || !name.split('.').all(label_ok) {
        return Err(EndpointProblem::BadHostName);
    }
    Ok(Host::Name(host.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> Endpoint {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn bad(s: &str) -> EndpointProblem {
        let err = s.parse::<Endpoint>().unwrap_err();
        assert!(err.to_string().contains("expected ADDR:PORT"), "{err}");
        err.problem
    }

    #[test]
    fn good_addresses_parse_and_print_back() {
        for (input, shown) in [
            ("10.0.0.2:29500", "10.0.0.2:29500"),
            ("0.0.0.0:0", "0.0.0.0:0"),
            ("[::1]:29500", "[::1]:29500"),
            ("[fe80::1:2]:65535", "[fe80::1:2]:65535"),
            ("[::]:1", "[::]:1"),
            ("localhost:29500", "localhost:29500"),
            ("node-7.cluster.example:80", "node-7.cluster.example:80"),
            ("fqdn.example.:80", "fqdn.example.:80"),
            ("10.0.0.2:00080", "10.0.0.2:80"),
        ] {
            assert_eq!(ok(input).to_string(), shown);
        }
        assert_eq!(ok("[::1]:7").port(), 7);
        let sa: SocketAddr = "[::1]:9".parse().unwrap();
        assert_eq!(Endpoint::from_socket_addr(sa), ok("[::1]:9"));
    }

    #[test]
    fn bad_addresses_say_what_is_wrong() {
        use EndpointProblem::*;
        for (input, problem) in [
            ("", MissingPort),
            ("10.0.0.2", MissingPort),
            ("10.0.0.2:", MissingPort),
            ("host", MissingPort),
            ("[::1]", MissingPort),
            ("[::1]:", MissingPort),
            ("10.0.0.2:65536", BadPort),
            ("10.0.0.2:-1", BadPort),
            ("10.0.0.2:+80", BadPort),
            ("10.0.0.2:http", BadPort),
            ("10.0.0.2: 80", BadPort),
            (":80", EmptyHost),
            ("::1:80", Ipv6NeedsBrackets),
            ("fe80::1:80", Ipv6NeedsBrackets),
            ("[::1:80", BadBracketedAddress),
            ("[10.0.0.1]:80", BadBracketedAddress),
            ("[host]:80", BadBracketedAddress),
            ("[::1]80", BadBracketedAddress),
            ("1.2.3:80", BadIpv4),
            ("256.0.0.1:80", BadIpv4),
            ("1..2.3:80", BadIpv4),
            ("bad_host:80", BadHostName),
            ("-lead:80", BadHostName),
            ("a..b:80", BadHostName),
            ("has space:80", BadHostName),
            ("héllo:80", BadHostName),
        ] {
            assert_eq!(bad(input), problem, "{input:?}");
        }
        let long = format!("{}:80", vec!["a".repeat(63); 5].join("."));
        assert_eq!(bad(&long), BadHostName);
        let label = format!("{}.x:80", "a".repeat(64));
        assert_eq!(bad(&label), BadHostName);
    }

    #[test]
    fn ip_endpoints_resolve_without_a_lookup() {
        assert_eq!(
            ok("127.0.0.1:5").resolve().unwrap(),
            vec!["127.0.0.1:5".parse::<SocketAddr>().unwrap()]
        );
        assert!(!ok("localhost:5").resolve().unwrap().is_empty());
    }
}

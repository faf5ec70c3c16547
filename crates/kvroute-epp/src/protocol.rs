//! The Endpoint Picker protocol's pure parts (Gateway API Inference Extension, proposal 004,
//! on Envoy's ext_proc): where a worker is as `ip:port`, the gateway's subset hint, the
//! messages that name the chosen endpoint, and an [`ImmediateResponse`] made from the answer
//! `kvroute serve` would give.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse, body_mutation,
    processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value};
use kvroute_serve::edge::Shed;

/// The request header naming the chosen endpoint.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The dynamic-metadata namespace the endpoint is also named in.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The filter-metadata namespace and key of the gateway's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";

/// A worker base URL's `host:port` (`http://10.0.0.7:8000` → `10.0.0.7:8000`), the form the
/// gateway's original-destination cluster connects to; None without a port.
pub fn endpoint_of(url: &str) -> Option<&str> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let (_, port) = authority.rsplit_once(':')?;
    (!port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())).then_some(authority)
}

/// The endpoints the gateway allows for this request (`envoy.lb.subset_hint`), or None when
/// it sets no hint (every worker of the pool is allowed). The list may be given as a list of
/// strings or as one comma-separated string.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let hint = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let value = hint.fields.get(SUBSET_KEY)?;
    let mut out = Vec::new();
    match &value.kind {
        Some(value::Kind::ListValue(list)) => {
            for v in &list.values {
                if let Some(value::Kind::StringValue(s)) = &v.kind {
                    out.extend(split_endpoints(s));
                }
            }
        }
        Some(value::Kind::StringValue(s)) => out.extend(split_endpoints(s)),
        _ => {}
    }
    Some(out)
}

fn split_endpoints(s: &str) -> impl Iterator<Item = String> + '_ {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
}

/// One header's value as Envoy sends it (`raw_value`, or `value` from older gateways).
pub fn header_bytes(header: &HeaderValue) -> &[u8] {
    if header.raw_value.is_empty() {
        header.value.as_bytes()
    } else {
        &header.raw_value
    }
}

/// The request's headers as an HTTP header map (pseudo-headers left out), its `:path` and
/// `:method`.
pub fn request_head(headers: &HttpHeaders) -> (hyper::HeaderMap, String, String) {
    let mut map = hyper::HeaderMap::new();
    let (mut path, mut method) = (String::new(), String::new());
    for h in headers.headers.iter().flat_map(|m| m.headers.iter()) {
        let value = header_bytes(h);
        match h.key.as_str() {
            ":path" => path = String::from_utf8_lossy(value).into_owned(),
            ":method" => method = String::from_utf8_lossy(value).into_owned(),
            k if k.starts_with(':') => {}
            k => {
                if let (Ok(name), Ok(v)) = (
                    hyper::header::HeaderName::from_bytes(k.as_bytes()),
                    hyper::header::HeaderValue::from_bytes(value),
                ) {
                    map.append(name, v);
                }
            }
        }
    }
    (map, path, method)
}

/// A response's `:status` (0 when missing or malformed).
pub fn response_status(headers: &HttpHeaders) -> u16 {
    headers
        .headers
        .iter()
        .flat_map(|m| m.headers.iter())
        .find(|h| h.key == ":status")
        .and_then(|h| std::str::from_utf8(header_bytes(h)).ok()?.parse().ok())
        .unwrap_or(0)
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The answer to the request headers naming `endpoint` (header and `envoy.lb` dynamic
/// metadata, the same value), with the body's length when the EPP sends the body back.
pub fn destination(endpoint: &str, body_length: Option<usize>) -> ProcessingResponse {
    let mut set_headers = vec![set_header(DESTINATION_HEADER, endpoint)];
    if let Some(n) = body_length {
        set_headers.push(set_header("content-length", &n.to_string()));
    }
    let lb = Struct {
        fields: HashMap::from([(
            DESTINATION_HEADER.to_owned(),
            Value {
                kind: Some(value::Kind::StringValue(endpoint.to_owned())),
            },
        )]),
    };
    let metadata = Struct {
        fields: HashMap::from([(
            DESTINATION_NAMESPACE.to_owned(),
            Value {
                kind: Some(value::Kind::StructValue(lb)),
            },
        )]),
    };
    ProcessingResponse {
        dynamic_metadata: Some(metadata),
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse {
                    header_mutation: Some(HeaderMutation {
                        set_headers,
                        ..Default::default()
                    }),
                    clear_route_cache: true,
                    ..Default::default()
                }),
            },
        )),
        ..Default::default()
    }
}

/// A body chunk handed back unchanged (full-duplex streaming: what the EPP does not send back,
/// the worker, or the client, does not get); `request`: the request's body, else the
/// response's.
pub fn body_back(body: &[u8], end_of_stream: bool, request: bool) -> ProcessingResponse {
    let response = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body: body.to_vec(),
                        end_of_stream,
                        ..Default::default()
                    },
                )),
            }),
            ..Default::default()
        }),
    };
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestBody(response)
        } else {
            processing_response::Response::ResponseBody(response)
        }),
        ..Default::default()
    }
}

/// "Go on unchanged" for the response's headers, body chunk or trailers.
pub fn carry_on(kind: Part) -> ProcessingResponse {
    use processing_response::Response;
    let headers = || HeadersResponse {
        response: Some(CommonResponse::default()),
    };
    let response = match kind {
        Part::ResponseHeaders => Response::ResponseHeaders(headers()),
        Part::ResponseBody => Response::ResponseBody(BodyResponse {
            response: Some(CommonResponse::default()),
        }),
        Part::RequestTrailers => Response::RequestTrailers(TrailersResponse::default()),
        Part::ResponseTrailers => Response::ResponseTrailers(TrailersResponse::default()),
    };
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

/// The parts of an exchange answered with [`carry_on`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    ResponseHeaders,
    ResponseBody,
    RequestTrailers,
    ResponseTrailers,
}

/// The status the gateway answers for a refusal `kvroute serve` gives with `status`: 429 Too
/// Many Requests when it sheds load (the protocol's status for shedding; serve's own is a
/// proxy's 503), serve's status otherwise. "No eligible endpoint" (none available, none in the
/// subset hint, a drain) is no shedding: it stays 503, as the protocol asks.
pub fn gateway_status(status: u16, shed: Option<Shed>) -> u16 {
    match shed {
        Some(Shed::BodyBudget) => 429,
        None => status,
    }
}

/// An answer the gateway sends the client itself instead of proxying: `status`, its headers
/// (`content-type`, `retry-after`), its body.
pub fn immediate(status: u16, headers: &[(String, String)], body: Vec<u8>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(HeaderMutation {
                    set_headers: headers.iter().map(|(k, v)| set_header(k, v)).collect(),
                    ..Default::default()
                }),
                body,
                details: format!("kvroute_epp_{status}"),
                ..Default::default()
            },
        )),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn hint(value: value::Kind) -> Metadata {
        let inner = Struct {
            fields: HashMap::from([(SUBSET_KEY.to_owned(), Value { kind: Some(value) })]),
        };
        Metadata {
            filter_metadata: HashMap::from([(SUBSET_NAMESPACE.to_owned(), inner)]),
            ..Default::default()
        }
    }

    #[test]
    fn shedding_is_429_at_the_gateway_and_other_refusals_keep_serve_s_status() {
        assert_eq!(gateway_status(503, Some(Shed::BodyBudget)), 429);
        assert_eq!(gateway_status(503, None), 503);
        assert_eq!(gateway_status(413, None), 413);
    }

    #[test]
    fn a_worker_url_gives_its_host_and_port() {
        assert_eq!(endpoint_of("http://10.0.0.7:8000"), Some("10.0.0.7:8000"));
        assert_eq!(endpoint_of("http://[::1]:8000/v1"), Some("[::1]:8000"));
        assert_eq!(endpoint_of("http://worker"), None);
    }

    #[test]
    fn the_subset_hint_is_read_as_a_list_or_a_comma_string() {
        let list = hint(value::Kind::ListValue(ListValue {
            values: vec![
                Value {
                    kind: Some(value::Kind::StringValue("10.0.0.1:80".into())),
                },
                Value {
                    kind: Some(value::Kind::StringValue("10.0.0.2:80".into())),
                },
            ],
        }));
        assert_eq!(
            subset_hint(Some(&list)),
            Some(vec!["10.0.0.1:80".to_owned(), "10.0.0.2:80".to_owned()])
        );
        let text = hint(value::Kind::StringValue("10.0.0.1:80, 10.0.0.3:80".into()));
        assert_eq!(
            subset_hint(Some(&text)),
            Some(vec!["10.0.0.1:80".to_owned(), "10.0.0.3:80".to_owned()])
        );
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
        assert_eq!(subset_hint(None), None);
    }

    #[test]
    fn the_destination_is_named_in_the_header_and_the_metadata_alike() {
        let r = destination("10.0.0.1:80", Some(12));
        let Some(processing_response::Response::RequestHeaders(h)) = &r.response else {
            panic!("a request-headers answer");
        };
        let set = &h
            .response
            .as_ref()
            .unwrap()
            .header_mutation
            .as_ref()
            .unwrap()
            .set_headers;
        let header = set[0].header.as_ref().unwrap();
        assert_eq!(header.key, DESTINATION_HEADER);
        assert_eq!(header.raw_value, b"10.0.0.1:80");
        let lb = &r.dynamic_metadata.as_ref().unwrap().fields[DESTINATION_NAMESPACE];
        let Some(value::Kind::StructValue(lb)) = &lb.kind else {
            panic!("a struct");
        };
        assert_eq!(
            lb.fields[DESTINATION_HEADER].kind,
            Some(value::Kind::StringValue("10.0.0.1:80".into()))
        );
        let length = set[1].header.as_ref().unwrap();
        assert_eq!(
            (length.key.as_str(), &length.raw_value[..]),
            ("content-length", &b"12"[..])
        );
    }
}

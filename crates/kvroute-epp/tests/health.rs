//! The EPP's gRPC health services as a gateway or the kubelet asks for them: `liveness`
//! SERVING from the start, `readiness` and the ext_proc service SERVING only once the worker set
//! is known, and NOT_SERVING again while draining.

use std::time::Duration;

use kvroute_epp::{EXT_PROC_SERVICE, Epp};
use kvroute_serve::{ServeConfig, WorkerSpec};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn status(epp: &Epp, service: &str) -> ServingStatus {
    let url = format!("http://{}", epp.grpc_addr());
    let service = service.to_owned();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let channel = tonic::transport::Channel::from_shared(url)
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = HealthClient::new(channel);
        let answer = client
            .check(HealthCheckRequest { service })
            .await
            .unwrap()
            .into_inner();
        ServingStatus::try_from(answer.status).unwrap()
    })
}

#[test]
fn readiness_waits_for_the_worker_set_and_drops_on_drain() {
    let config = ServeConfig {
        health_interval: None,
        ..ServeConfig::default()
    };
    let epp = Epp::start(config, 0).unwrap();
    assert_eq!(status(&epp, "liveness"), ServingStatus::Serving);
    assert_eq!(status(&epp, "readiness"), ServingStatus::NotServing);
    assert_eq!(status(&epp, EXT_PROC_SERVICE), ServingStatus::NotServing);
    epp.set_workers(&[WorkerSpec::url("http://127.0.0.1:9")])
        .unwrap();
    assert_eq!(status(&epp, "readiness"), ServingStatus::Serving);
    assert_eq!(status(&epp, EXT_PROC_SERVICE), ServingStatus::Serving);
    assert!(epp.drain(Duration::from_millis(10)));
    assert_eq!(status(&epp, "readiness"), ServingStatus::NotServing);
    assert_eq!(status(&epp, "liveness"), ServingStatus::Serving);
    epp.shutdown();
}

//! Services, EndpointSlices and this node's Node object, from the API server (kube-rs) or from
//! manifest files, turned into the diff engine's model.

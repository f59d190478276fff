//! The MCP import authenticating to an HTTP MCP server with OAuth 2.1
//! (client credentials, the `resource` parameter).

mod support;

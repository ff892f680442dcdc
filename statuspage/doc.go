// Package statuspage renders the status page every daemon serves at / on
// its HTTP address: on a master, the members and the leader, every
// segment's usage by tier, the prefix hit ratio by tier and the leader's
// recent events (evictions, drains, stores declared dead, elections); on a
// store, its segments and its rails. The page is rendered on the server
// (html/template, the template embedded), reads without JavaScript,
// reloads itself, and loads nothing from elsewhere.
//
// Numbers carry data- attributes with their exact values, so tools and
// tests read them without parsing the human-readable text.
package statuspage

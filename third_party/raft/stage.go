// Copyright (c) Tidepool authors
// SPDX-License-Identifier: MPL-2.0

package raft

import "fmt"

// LogStager is a LogStore that can make entries readable before they are
// stored. With one, the leader sends new entries to its followers while it
// writes them to its own log, instead of after, and counts itself toward
// their commitment only once its own write is done: an entry still commits
// only when a majority has it on disk, which may be the followers without
// the leader (Ongaro's thesis, section 10.2.1). On a write that fails, the
// leader steps down, so no later entry of its term can take the index of
// one a follower may already hold.
type LogStager interface {
	// StageLogs makes logs, consecutive entries, readable through GetLog
	// (besides what is stored) until the next StageLogs; nil unstages.
	// StoreLogs leaves the stage as it is.
	StageLogs(logs []*Log)
}

// stageable reports whether logs may be sent before they are stored.
// Not a configuration: appendConfigurationEntry switches the commitment
// to the new configuration only after dispatchLogs returns, and the
// followers' acknowledgements would meanwhile count under the old one.
func stageable(logs []*Log) bool {
	for _, l := range logs {
		if l.Type == LogConfiguration {
			return false
		}
	}
	return true
}

// dispatchStaged is the end of dispatchLogs for a LogStager: logs are
// staged and sent while they are written.
func (r *Raft) dispatchStaged(st LogStager, applyLogs []*logFuture, logs []*Log, lastIndex, term uint64) {
	prevIndex, prevTerm := r.getLastLog()
	st.StageLogs(logs)
	r.setLastLog(lastIndex, term)
	for _, f := range r.leaderState.replState {
		asyncNotifyCh(f.triggerCh)
	}
	err := r.logs.StoreLogs(logs)
	if err != nil {
		// The last index goes back before the stage is dropped, so a
		// replicator that misses a staged entry finds it past the last
		// (see replicateTo).
		r.setLastLog(prevIndex, prevTerm)
	}
	st.StageLogs(nil)
	if err != nil {
		r.logger.Error("failed to commit logs", "error", err)
		// Followers may hold the entries, and a next leader commit them:
		// the outcome is unknown, as when leadership is lost.
		err = fmt.Errorf("%w: %w", ErrLeadershipLost, err)
		for _, applyLog := range applyLogs {
			applyLog.respond(err)
		}
		r.setState(Follower)
		return
	}
	r.leaderState.commitment.match(r.localID, lastIndex)
}

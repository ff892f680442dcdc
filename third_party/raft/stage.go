// Copyright (c) Tidepool authors
// SPDX-License-Identifier: MPL-2.0

package raft

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
	// until the StoreLogs of them that follows returns, whether it
	// succeeds or fails.
	StageLogs(logs []*Log)
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
	if err := r.logs.StoreLogs(logs); err != nil {
		r.logger.Error("failed to commit logs", "error", err)
		r.setLastLog(prevIndex, prevTerm)
		for _, applyLog := range applyLogs {
			applyLog.respond(err)
		}
		r.setState(Follower)
		return
	}
	r.leaderState.commitment.match(r.localID, lastIndex)
}

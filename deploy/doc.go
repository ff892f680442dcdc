// Package deploy holds the checks of Tidepool's deployment artefacts: the
// Helm chart in helm/tidepool is rendered with Helm's own engine and every
// manifest decoded strictly into its Kubernetes API type, and every flag a
// manifest passes is one the tidepool binary knows.
//
// It is a module of its own so that Helm and the Kubernetes API types are
// no dependency of the tidepool binary.
package deploy
